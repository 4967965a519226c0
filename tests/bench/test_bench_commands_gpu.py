"""The GPU bench commands end to end on CUDA with the tiny shape (make test-gpu): every
library module they share runs on the device path (the bandwidth and GEMM rates, burst and
sustained, the FP8 GEMM, graph-replayed GEMV calls, the offline runner, the profiler), and
each command still prints its table and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--tiny", "--max-batch", "8", "--max-num-tokens", "256", "--max-model-len", "256"]


def bench(module: str, *args: str, out: Path) -> str:
    run = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OUT": str(out)})  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def test_gpu_bench_runs_its_workloads_and_profile_on_cuda(tmp_path: Path) -> None:
    # the default token and length limits: the profiled steps go up to 4 x 2048 tokens at context 2048
    stdout = bench("bench.gpu_bench", "--tiny", "--skip-hf", "--workloads", "16/16", "--profile", "--direct",
                   out=tmp_path)  # fmt: skip
    assert "tokenwire tok/s" in stdout and "TFLOP/s" in stdout
    saved = json.loads((tmp_path / "gpu_bench.json").read_text())
    [row] = saved["rows"]
    assert row["output_tokens"] == row["requests"] * 16
    assert saved["gemm_sustained_TFLOPps"] > 0  # the sustained rate measured on CUDA
    assert list(tmp_path.glob("profile_*.txt"))


@pytest.mark.parametrize("quantization", ["fp8", "int4"])
def test_quantized_gpu_bench_runs_on_cuda(tmp_path: Path, quantization: str) -> None:
    stdout = bench("bench.gpu_bench", *SMALL, "--quantization", quantization, out=tmp_path)
    assert "TPOT floor ms" in stdout
    saved = json.loads((tmp_path / f"gpu_bench_{quantization}.json").read_text())
    assert any(r["workload"].startswith("batch 1") for r in saved["rows"])
    if quantization == "fp8":
        assert saved["gemm_fp8_TFLOPps"] > 0 and {r.get("kv_cache") for r in saved["rows"]} == {"bf16", "fp8"}
        offline = [r for r in saved["rows"] if not r["workload"].startswith("batch 1")]
        assert all(r["batch_cap"] == 8 and r["requests"] % 8 == 0 for r in offline)  # --max-batch 8 fills them
    else:
        assert saved["int4_batch1_gemv"]  # the GEMV rows, replayed from CUDA graphs


def test_lora_bench_runs_on_cuda(tmp_path: Path) -> None:
    stdout = bench("bench.lora_bench", "--tiny", out=tmp_path)
    assert "adapters" in stdout


def test_kv_tier_bench_runs_on_cuda(tmp_path: Path) -> None:
    stdout = bench("bench.kv_tier_bench", "--tiny", out=tmp_path)
    assert "device + host tier" in stdout
    runs = json.loads((tmp_path / "kv_tier_bench.json").read_text())["runs"]
    assert runs[0]["host_tokens"] == 0 and runs[1]["host_tokens"] > 0
