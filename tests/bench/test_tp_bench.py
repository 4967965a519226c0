"""The multi-GPU bench's quantization axis, on the CPU (gloo, two rank processes, the
tiny model): the ranks quantize their shards, the roofline counts the quantized bytes,
and a saved run's table re-renders with the same roofline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.gpu_bench import table_from_json
from bench.model_shapes import TINY
from bench.roofline import quantized_roofline, roofline_for
from worker.models.config import ModelConfig

REPO = Path(__file__).resolve().parents[2]


def test_fp8_over_two_ranks_quantizes_and_counts_fp8_bytes(tmp_path: Path) -> None:
    args = ["--tiny", "--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", "2", "--quantization", "fp8",
            "--skip-hf", "--max-batch", "8", "--max-num-tokens", "256", "--max-model-len", "256",
            "--workloads", "16/16"]  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "bench.gpu_bench", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OUT": str(tmp_path)})  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rank 0 runs fp8 weights" in run.stdout  # what the backend says it built, not the flag

    saved = json.loads((tmp_path / "gpu_bench_tiny_tp2_fp8.json").read_text())
    assert saved["quantization"] == "fp8" and saved["tensor_parallel_size"] == 2
    [row] = saved["rows"]
    assert row["output_tokens"] == row["requests"] * 16
    cfg = ModelConfig.from_hf(TINY)
    bandwidth, flops = saved["bandwidth_TBps"] * 1e12, saved["gemm_TFLOPps"] * 1e12
    fp8 = quantized_roofline(cfg, "fp8", 2, bandwidth, flops)
    assert saved["weight_GB"] * 1e9 == fp8.weight_bytes < roofline_for(cfg, bandwidth, flops, 2).weight_bytes

    # Re-rendered with a GPU's compute ceiling (the CPU's makes both rooflines compute-bound):
    # memory-bound, the fp8 bytes must show.
    saved["gemm_TFLOPps"] = 1e6
    (tmp_path / "fast.json").write_text(json.dumps(saved))
    header, rows = table_from_json(str(tmp_path / "fast.json"))
    extra = row["extra"]
    concurrency = min(extra["max_batch"], row["requests"], extra["kv_tokens"] // 32)
    want = quantized_roofline(cfg, "fp8", 2, bandwidth, 1e18).offline_tok_s(16, 16, row["requests"], concurrency)
    bf16 = roofline_for(cfg, bandwidth, 1e18, 2).offline_tok_s(16, 16, row["requests"], concurrency)
    assert rows[0][header.index("roofline tok/s")] == f"{want:,.0f}" != f"{bf16:,.0f}"
