"""gpt-oss's MXFP4 experts on CUDA as the checkpoint packs them (make test-gpu): the model
path hands the packed bytes to the fused kernel's MXFP4 variant, which gives the greedy
tokens of the same model with those values held in bf16; the experts hold on the GPU the
bytes packing implies (half a byte a weight, a scale byte per 32), no float copy; and the
bench's gpt-oss shape runs with its experts made packed."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.worker.backends.greedy_driver import greedy_run
from tests.worker.models.mxfp4_checkpoints import mxfp4_and_float_twins
from worker.backends.fused_moe import dequantize_expert
from worker.backends.torch_backend import TorchBackend
from worker.models.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
REPO = Path(__file__).resolve().parents[2]
PROMPTS = {s: np.random.default_rng(i).integers(3, 250, 9 + 7 * i).tolist() for i, s in enumerate("abcd")}


def moe_layers(backend: TorchBackend) -> list[Any]:
    return [layer.experts for layer in backend.model.layers if layer.experts is not None]


def test_packed_experts_give_the_tokens_of_their_values_in_bf16(tmp_path: Path) -> None:
    packed_dir, exact_dir = mxfp4_and_float_twins(tmp_path)
    packed = TorchBackend(load_model(packed_dir), device="cuda", dtype="bfloat16", max_model_len=128)
    exact = TorchBackend(load_model(exact_dir), device="cuda", dtype="bfloat16", max_model_len=128)
    packed_layers, exact_layers = moe_layers(packed), moe_layers(exact)
    assert packed_layers and all(e.fused.format == "mxfp4" and e.gate_up is None and e.down is None
                                 for e in packed_layers)  # fmt: skip
    assert all(e.fused.format == "bf16" for e in exact_layers)
    # The kernel reads the same values either way: E2M1 codes times powers of two are exact in bf16.
    for p, x in zip(packed_layers, exact_layers, strict=True):
        for e in range(p.fused.num_experts):
            for pw, xw in zip(dequantize_expert(p.fused, e), dequantize_expert(x.fused, e), strict=True):
                assert torch.equal(pw, xw)
        assert torch.equal(p.fused.gate_up_bias, x.fused.gate_up_bias)

    results = []
    for backend in (packed, exact):
        backend.allocate_kv_cache(num_blocks=128, block_size=16)
        results.append(greedy_run(backend, PROMPTS, 16, seed=1, block_size=16, num_blocks=128, chunk=8))
    assert packed._graphs is not None and packed._graphs.graphs, "no decode step went through a CUDA graph"
    assert results[0] == results[1]


def test_packed_experts_hold_the_bytes_packing_implies(tmp_path: Path) -> None:
    packed_dir, exact_dir = mxfp4_and_float_twins(tmp_path)
    cfg = load_model(packed_dir, load_weights=False).config
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size

    def words(inputs: int) -> int:  # scale words a row: four 32-input groups each
        return -(-inputs // 128)

    scale_bytes = 4 * (2 * i * words(h) + h * words(i))  # an expert's
    held = {}
    for label, directory in (("mxfp4", packed_dir), ("bf16", exact_dir)):
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        backend = TorchBackend(load_model(directory), device="cuda", dtype="bfloat16", max_model_len=64,
                               use_cuda_graphs=False)  # fmt: skip
        held[label] = torch.cuda.memory_allocated() - before
        if label == "mxfp4":
            for experts in moe_layers(backend):
                f = experts.fused
                assert f.gate_up.dtype == f.down.dtype == torch.uint8
                assert f.gate_up_scale.dtype == f.down_scale.dtype == torch.int32  # four E8M0 scales a word
                assert tuple(f.gate_up.shape) == (e, 2 * i, h // 2)
                assert tuple(f.gate_up_scale.shape) == (e, words(h), 2 * i)
                assert tuple(f.down.shape) == (e, h, i // 2) and tuple(f.down_scale.shape) == (e, words(i), h)
                # an expert's 3 h i weights at half a byte, its scale words, then its bf16 biases
                assert f.nbytes_per_expert() == 3 * h * i // 2 + scale_bytes + (2 * i + h) * 2
        del backend
    # The whole model: every expert weight 2 bytes in bf16, half a byte packed plus its
    # scales; the rest alike (the allocator rounds each of a layer's 4 packed tensors to 512 bytes).
    layers = len(cfg.moe_layers)
    weights = layers * e * 3 * h * i
    packed = weights // 2 + layers * e * scale_bytes
    assert held["bf16"] - held["mxfp4"] == pytest.approx(weights * 2 - packed, abs=4 * 512 * layers)


@pytest.mark.slow
def test_gpt_oss_bench_shape_runs_with_packed_experts_on_cuda(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.gpu_bench", "--model-shape", "gpt-oss-20b", "--tiny", "--skip-hf",
               "--max-batch", "8", "--max-num-tokens", "256", "--max-model-len", "256",
               "--workloads", "16/16,64/8"]  # fmt: skip
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OUT": str(tmp_path)})  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "rank 0 runs bfloat16 weights, a bfloat16 KV cache, MXFP4 experts" in run.stdout
    saved = json.loads((tmp_path / "gpu_bench_gpt-oss-20b-tiny_tp1_mxfp4.json").read_text())
    assert [r["output_tokens"] for r in saved["rows"]] == [saved["rows"][0]["requests"] * 16,
                                                          saved["rows"][1]["requests"] * 8]  # fmt: skip
