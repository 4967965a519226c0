"""LoRA cases for tests/worker/backends/test_lora_kernel.py, and the child process that runs
them through the Triton kernels under Triton's interpreter.

Triton picks interpreter or compiler when it is imported (its standard library's @jit
functions are made then), so the interpreted run needs a process that sets
TRITON_INTERPRET=1 before importing it:

    TRITON_INTERPRET=1 python -m tests.worker.backends.lora_interpreted < cases.json

reads a JSON list of cases (keyword arguments of `lora_case`, plus "config": the
LaunchConfig fields or null for the shapes' own; optional "strided" and "given_plan") and
prints, per case, how far the kernels' output is from the reference and whether anything
they must not touch changed.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def lora_case(t: int, n_in: int, n_out: int, rank: int, num_slots: int, dtype: str, seed: int = 0,
              no_adapter: float = 0.25, runs: list[list[int]] | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Random inputs; a `no_adapter` share of the tokens with slot -1, the rest spread over
    the slots; or, with `runs` ([slot, length] pairs summing to t), runs of one slot each,
    as prefill chunks are."""
    g = torch.Generator().manual_seed(seed)
    if runs is None:
        slots = torch.randint(0, num_slots, (t,), generator=g)
        slots[torch.rand(t, generator=g) < no_adapter] = -1
    else:
        slots = torch.cat([torch.full((n,), s) for s, n in runs])
    dt = DTYPES[dtype]
    return {
        "y": torch.randn(t, n_out, generator=g).to(dt),
        "x": torch.randn(t, n_in, generator=g).to(dt),
        "a": (torch.randn(num_slots, rank, n_in, generator=g) / n_in**0.5).to(dt),
        "b": (torch.randn(num_slots, n_out, rank, generator=g) / rank**0.5).to(dt),
        "slots": slots,
    }


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """The kernels on one case. With "strided", x and y are column slices of wider buffers
    (rows strided, as views of a fused output are) whose other columns must not change."""
    from worker.backends.lora_kernel import LaunchConfig, add_lora_reference, add_lora_triton, plan_lora

    config = case.pop("config")
    strided = case.pop("strided", False)
    given_plan = case.pop("given_plan", False)
    c = lora_case(**case)
    x, y = c["x"], c["y"]
    wide_y = y
    if strided:
        wide_x = torch.randn(x.shape[0], x.shape[1] + 32).to(x.dtype)
        wide_x[:, 16 : 16 + x.shape[1]] = x
        wide_y = torch.randn(y.shape[0], y.shape[1] + 48).to(y.dtype)
        wide_y[:, 8 : 8 + y.shape[1]] = y
        x, y = wide_x[:, 16 : 16 + x.shape[1]], wide_y[:, 8 : 8 + y.shape[1]]
    wide_before = wide_y.clone()
    y0 = y.clone()
    want = y.clone()
    add_lora_reference(want, x, c["a"], c["b"], c["slots"])
    plan = plan_lora(c["slots"], c["a"].shape[0]) if given_plan else None
    add_lora_triton(y, x, c["a"], c["b"], c["slots"], None if config is None else LaunchConfig(**config), plan)
    minus_one = c["slots"] < 0
    outside = torch.ones_like(wide_y, dtype=torch.bool)
    if strided:
        outside[:, 8 : 8 + y.shape[1]] = False
    delta = float((want.double() - y0.double()).norm())
    return {
        "rel_err": float((y.double() - want.double()).norm()) / delta if delta else float((y - want).abs().max()),
        "slot_minus_one_rows_untouched": bool(torch.equal(y[minus_one], y0[minus_one])),
        "outside_columns_untouched": bool(torch.equal(wide_y[outside], wide_before[outside])) if strided else True,
        "adapter_tokens": int((~minus_one).sum()),
    }


def main() -> None:
    cases = json.load(sys.stdin)
    print(json.dumps([run_case(case) for case in cases]))


if __name__ == "__main__":
    main()
