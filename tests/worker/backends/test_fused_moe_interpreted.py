"""The fused MoE kernel against a float32 reference on the CPU, run by Triton's interpreter
(and gpt-oss's packed MXFP4 layers as the model path builds them, and a layer's experts
split in halves as expert-parallel ranks stack them), in a process of its own
(TRITON_INTERPRET must be set before the kernels are defined: interpreted_fused_moe.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[3]


def test_fused_moe_matches_float32_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "tests.worker.backends.interpreted_fused_moe"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check_align: ok" in proc.stdout
    assert "check_fused_moe: ok" in proc.stdout
    assert "check_gpt_oss_packed_layers: ok" in proc.stdout
    assert "check_expert_parallel_halves: ok" in proc.stdout
