"""gpu_bench at the Qwen3 and Gemma 3 shapes, tiny, end to end on the CPU: the ranks make
every tensor the family lists (q/k norms, Gemma's sandwich norms), run the workloads float
or quantized to FP8 with an FP8 KV cache, and save the roofline of that shape; at the
gpt-oss shape with its experts made packed in MXFP4, counted at their packed bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.model_shapes import hf_config
from bench.roofline import roofline_of
from worker.models.config import ModelConfig

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--tiny", "--device", "cpu", "--dtype", "float32", "--skip-hf", "--max-batch", "8",
         "--max-num-tokens", "256", "--max-model-len", "256", "--workloads", "16/16,64/8"]  # fmt: skip


@pytest.mark.parametrize("shape", ["qwen3-8b", "gemma3-12b"])
@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
def test_tiny_family_shape_runs_its_workloads(shape: str, fp8: bool, tmp_path: Path) -> None:
    quant = ["--quantization", "fp8", "--kv-cache-dtype", "fp8"] if fp8 else []
    command = [sys.executable, "-m", "bench.gpu_bench", "--model-shape", shape, *SMALL, *quant]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OUT": str(tmp_path)})  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    kind = "fp8" if fp8 else "float32"
    assert f"rank 0 runs {kind} weights, a {kind} KV cache" in run.stdout

    saved = json.loads((tmp_path / f"gpu_bench_{shape}-tiny_tp1{'_fp8' if fp8 else ''}.json").read_text())
    assert saved["model_shape"] == f"{shape}-tiny"
    assert [(r["workload"], r["output_tokens"]) for r in saved["rows"]] == [
        ("16/16", saved["rows"][0]["requests"] * 16),
        ("64/8", saved["rows"][1]["requests"] * 8),
    ]
    cfg = ModelConfig.from_hf(hf_config(f"{shape}-tiny"))
    roof = roofline_of(cfg, "fp8" if fp8 else None, 4, 1.0, 1.0, kv_cache_dtype="fp8" if fp8 else None)
    assert round(saved["weight_GB"] * 1e9) == roof.weight_bytes


def test_tiny_gpt_oss_shape_runs_with_packed_mxfp4_experts(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.gpu_bench", "--model-shape", "gpt-oss-20b", *SMALL]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OUT": str(tmp_path)})  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "a float32 KV cache, MXFP4 experts" in run.stdout  # the shape's default: as gpt-oss ships

    saved = json.loads((tmp_path / "gpu_bench_gpt-oss-20b-tiny_tp1_mxfp4.json").read_text())
    assert saved["expert_dtype"] == "mxfp4"
    assert [r["output_tokens"] for r in saved["rows"]] == [saved["rows"][0]["requests"] * 16,
                                                          saved["rows"][1]["requests"] * 8]  # fmt: skip
    cfg = ModelConfig.from_hf(hf_config("gpt-oss-20b-tiny"))
    roof = roofline_of(cfg, None, 4, 1.0, 1.0, expert_dtype="mxfp4")
    assert roof.expert_bytes == roof.expert_params * 17 // 32  # half a byte a weight, a scale byte per 32
    assert round(saved["expert_GB"] * 1e9) == roof.expert_bytes * roof.experts
