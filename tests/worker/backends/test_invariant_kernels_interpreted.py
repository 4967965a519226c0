"""Deterministic mode's CUDA kernels in Triton's interpreter on the CPU, in a process of
its own (TRITON_INTERPRET must be set before the kernels are defined:
interpreted_invariant_kernels.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[3]


def test_invariant_kernels_match_torch_and_ignore_batch_mates_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "tests.worker.backends.interpreted_invariant_kernels"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == 4, proc.stdout
