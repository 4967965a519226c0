"""The LoRA kernels' module on the CPU: the torch reference (the CPU path, and the oracle of
tests/gpu/test_lora_kernel_gpu.py) against a per-token float64 loop, and the Triton kernels
themselves run by Triton's interpreter (TRITON_INTERPRET=1: numpy on the CPU, in a child
process, see lora_interpreted.py) against the reference, over every launch path: the slot
scan of small batches, the plan's tiles, split input dimension, several rank blocks, ragged
sizes, strided rows.

The interpreter runs fp16 and float32, not bf16: its tl.dot on bf16 operands is wrong (numpy
has no bfloat16); the GPU tests cover bf16. Tolerance, ||ours - ref|| / ||ref - y0||, the
error relative to the LoRA delta: fp16 1e-2 (rounding of the fp16 intermediate and output;
seen ~4e-4), float32 1e-5 (IEEE dots)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.backends.lora_interpreted import lora_case
from worker.backends import lora_kernel, sm_count
from worker.backends.lora_kernel import add_lora, add_lora_reference

TOLERANCE = {"float16": 1e-2, "float32": 1e-5}
REPO = Path(__file__).resolve().parents[3]


# -- the reference -------------------------------------------------------------------------------


def test_reference_equals_a_per_token_loop_and_leaves_slot_minus_one_rows_alone() -> None:
    c = lora_case(37, 24, 40, 8, 3, "float64", no_adapter=0.3)
    y0 = c["y"].clone()
    add_lora_reference(**c)
    for t in range(37):
        s = int(c["slots"][t])
        want = y0[t] if s < 0 else y0[t] + (c["x"][t] @ c["a"][s].T) @ c["b"][s].T
        torch.testing.assert_close(c["y"][t], want, rtol=1e-12, atol=1e-12)
    minus_one = c["slots"] < 0
    assert 0 < int(minus_one.sum()) < 37
    assert torch.equal(c["y"][minus_one], y0[minus_one])


def test_reference_keeps_the_dtype_and_rounds_once() -> None:
    c = lora_case(16, 32, 48, 16, 2, "bfloat16", seed=1, no_adapter=0.0)
    want = c["y"].double().clone()
    add_lora_reference(want, c["x"].double(), c["a"].double(), c["b"].double(), c["slots"])
    add_lora_reference(**c)
    assert c["y"].dtype == torch.bfloat16
    # float32 math, one rounding to bf16 at the end: within half a bf16 ulp (2^-9 relative) of float64.
    assert float((c["y"].double() - want).abs().max() / want.abs().max()) < 2**-8


def test_fused_parts_with_padded_ranks_act_as_separate_adapters() -> None:
    """A fused projection (qkv) stacks its parts' A rows and puts their B blocks on the
    diagonal; zero rows pad a part's smaller rank. That must equal each part alone."""
    g = torch.Generator().manual_seed(2)
    n_in, outs, ranks, pad = 32, (24, 8, 8), (4, 2, 3), 4
    x = torch.randn(5, n_in, generator=g, dtype=torch.float64)
    slots = torch.tensor([0, -1, 0, 0, -1])
    a = torch.zeros(1, 3 * pad, n_in, dtype=torch.float64)
    b = torch.zeros(1, sum(outs), 3 * pad, dtype=torch.float64)
    parts = []
    row = 0
    for i, (out, r) in enumerate(zip(outs, ranks, strict=True)):
        pa = torch.randn(1, r, n_in, generator=g, dtype=torch.float64)
        pb = torch.randn(1, out, r, generator=g, dtype=torch.float64)
        a[0, i * pad : i * pad + r] = pa[0]
        b[0, row : row + out, i * pad : i * pad + r] = pb[0]
        parts.append((pa, pb, row, out))
        row += out
    fused = torch.zeros(5, sum(outs), dtype=torch.float64)
    add_lora_reference(fused, x, a, b, slots)
    for pa, pb, first, out in parts:
        alone = torch.zeros(5, out, dtype=torch.float64)
        add_lora_reference(alone, x, pa, pb, slots)
        torch.testing.assert_close(fused[:, first : first + out], alone)


def test_add_lora_on_the_cpu_is_the_reference() -> None:
    c = lora_case(9, 16, 24, 8, 2, "float32", seed=3)
    want = c["y"].clone()
    add_lora_reference(want, c["x"], c["a"], c["b"], c["slots"])
    add_lora(c["y"], c["x"], c["a"], c["b"], c["slots"])
    assert torch.equal(c["y"], want)


@pytest.mark.parametrize(
    ("field", "bad", "match"),
    [
        ("a", torch.zeros(2, 8, 15), "do not fit"),
        ("b", torch.zeros(2, 24, 4), "do not fit"),
        ("slots", torch.zeros(8, dtype=torch.int64), "do not fit"),
        ("b", torch.zeros(2, 24, 8, dtype=torch.float64), "dtypes differ"),
    ],
)
def test_add_lora_rejects_mismatched_operands(field: str, bad: torch.Tensor, match: str) -> None:
    c = lora_case(9, 16, 24, 8, 2, "float32")
    c[field] = bad
    with pytest.raises(ValueError, match=match):
        add_lora(c["y"], c["x"], c["a"], c["b"], c["slots"])


# -- the Triton kernels, interpreted ----------------------------------------------------------------


def cfg(grouped: bool, block_m: int, block_k: int, block_r: int, split_k: int, block_n: int) -> dict[str, Any]:
    return {"grouped": grouped, "block_m": block_m, "block_k": block_k, "block_r": block_r, "split_k": split_k,
            "block_n": block_n, "num_warps": 4}  # fmt: skip


# name -> lora_case arguments and "config" (None: the shapes' own): every branch of the launch.
CASES: dict[str, dict[str, Any]] = {
    "decode-1-token-scan": {"t": 1, "n_in": 256, "n_out": 192, "rank": 16, "num_slots": 4, "dtype": "float16"},
    "decode-7-scan-padded-rank": {"t": 7, "n_in": 256, "n_out": 192, "rank": 48, "num_slots": 4, "dtype": "float16"},
    "scan-limit-ragged-out": {"t": 64, "n_in": 256, "n_out": 200, "rank": 48, "num_slots": 5, "dtype": "float32"},
    "just-past-scan-planned": {"t": 65, "n_in": 256, "n_out": 96, "rank": 16, "num_slots": 3, "dtype": "float16"},
    "planned-tiles-of-16": {"t": 300, "n_in": 256, "n_out": 384, "rank": 96, "num_slots": 6, "dtype": "float16"},
    "planned-tiles-of-64": {"t": 1100, "n_in": 128, "n_out": 64, "rank": 16, "num_slots": 3, "dtype": "float32"},
    "one-token-split-input": {"t": 1, "n_in": 1024, "n_out": 64, "rank": 16, "num_slots": 3, "dtype": "float16",
                              "no_adapter": 0.0},
    "planned-split-rank-blocks": {"t": 150, "n_in": 200, "n_out": 130, "rank": 96, "num_slots": 6,
                                  "dtype": "float16", "config": cfg(True, 16, 64, 32, 2, 64)},
    "planned-more-slots-than-16": {"t": 5, "n_in": 520, "n_out": 130, "rank": 40, "num_slots": 20,
                                   "dtype": "float32", "config": cfg(True, 16, 64, 16, 4, 32), "no_adapter": 0.0},
    "scan-split-ragged-input": {"t": 20, "n_in": 520, "n_out": 64, "rank": 40, "num_slots": 5, "dtype": "float16",
                                "config": cfg(False, 16, 64, 16, 3, 32)},
    "prefill-runs-strided-rows": {"t": 200, "n_in": 96, "n_out": 80, "rank": 16, "num_slots": 4, "dtype": "float16",
                                  "runs": [[2, 90], [-1, 30], [0, 80]], "strided": True},
    "planned-with-a-plan-made-apart": {"t": 150, "n_in": 256, "n_out": 96, "rank": 32, "num_slots": 5,
                                       "dtype": "float16", "given_plan": True},
    "no-adapter-scan": {"t": 3, "n_in": 64, "n_out": 32, "rank": 16, "num_slots": 3, "dtype": "float16",
                        "no_adapter": 1.0},
    "no-adapter-planned": {"t": 100, "n_in": 64, "n_out": 32, "rank": 16, "num_slots": 3, "dtype": "float16",
                           "no_adapter": 1.0},
}  # fmt: skip


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, Any]]:
    """Every case through the kernels in one child process (see lora_interpreted.py for why
    a child), seeded by its position."""
    pytest.importorskip("triton", reason="Triton is not installed: its interpreter cannot run the kernels")
    cases = [{"config": None, "seed": i, **case} for i, case in enumerate(CASES.values())]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "tests.worker.backends.lora_interpreted"], input=json.dumps(cases),
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400, check=False)  # fmt: skip
    assert done.returncode == 0, f"the interpreted run exited {done.returncode}: {done.stderr[-3000:]}"
    return dict(zip(CASES, json.loads(done.stdout), strict=True))


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernels_match_the_reference(interpreted: dict[str, dict[str, Any]], name: str) -> None:
    got = interpreted[name]
    assert got["slot_minus_one_rows_untouched"], got
    assert got["outside_columns_untouched"], got
    assert got["rel_err"] < TOLERANCE[CASES[name]["dtype"]], got
    no_adapter = CASES[name].get("no_adapter") == 1.0
    assert (got["adapter_tokens"] == 0) == no_adapter, got  # the case exercises what it is named for


def test_the_default_cases_take_the_paths_they_are_named_for() -> None:
    sms = sm_count.INTERPRETER_SMS
    assert not lora_kernel.launch_config(64, 256, 48, 5, sms).grouped
    assert lora_kernel.launch_config(65, 256, 16, 3, sms).grouped
    assert lora_kernel.launch_config(300, 256, 96, 6, sms).block_m == 16
    assert lora_kernel.launch_config(1100, 128, 16, 3, sms).block_m == 64
    assert lora_kernel.launch_config(1, 1024, 16, 3, sms).split_k > 1
    assert lora_kernel.launch_config(7, 256, 48, 4, sms).split_k == 1
