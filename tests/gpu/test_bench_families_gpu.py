"""gpu_bench at the tiny Qwen3 and Gemma 3 shapes on CUDA (make test-gpu): the ranks make
the family's tensors on the GPU and run the workloads through the Triton kernels (q/k
norms, sliding windows), in bf16 and quantized to FP8 with an FP8 KV cache."""

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
SMALL = ["--tiny", "--skip-hf", "--max-batch", "8", "--max-num-tokens", "256", "--max-model-len", "256",
         "--workloads", "16/16,64/8"]  # fmt: skip


@pytest.mark.parametrize("shape", ["qwen3-8b", "gemma3-12b"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_tiny_family_shape_runs_on_cuda(shape: str, fp8: bool, tmp_path: Path) -> None:
    quant = ["--quantization", "fp8", "--kv-cache-dtype", "fp8"] if fp8 else []
    command = [sys.executable, "-m", "bench.gpu_bench", "--model-shape", shape, *SMALL, *quant]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OUT": str(tmp_path)})  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"rank 0 runs {'fp8' if fp8 else 'bfloat16'} weights" in run.stdout
    saved = json.loads((tmp_path / f"gpu_bench_{shape}-tiny_tp1{'_fp8' if fp8 else ''}.json").read_text())
    assert [r["output_tokens"] for r in saved["rows"]] == [saved["rows"][0]["requests"] * 16,
                                                          saved["rows"][1]["requests"] * 8]  # fmt: skip
    assert saved["gemm_TFLOPps"] > 0
