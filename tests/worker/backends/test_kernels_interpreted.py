"""The Triton kernels (fused add + RMSNorm, the FP8 GEMM, the one-row GEMV and its SwiGLU twin, the
sampler's argmax + log-sum-exp (at every chunk count), SiLU * up, RoPE fused with the KV-cache write, paged
attention for decode, split decode and prefill, soft-capped under a window too, and with
attention sinks) against their torch
twins on the CPU, run by Triton's interpreter: kernel changes are checked here
before a GPU sees them. A process of its own, since TRITON_INTERPRET must be set
before the kernels are defined (interpreted_kernels.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[3]


def test_triton_kernels_match_torch_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "tests.worker.backends.interpreted_kernels"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == 12, proc.stdout
