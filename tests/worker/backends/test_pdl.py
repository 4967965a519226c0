"""Which launches ask for programmatic dependent launch (worker/backends/pdl.py): none
off CUDA, none in steps of more than one row (there our kernels follow cuBLAS GEMMs),
none when switched off. A graph of PDL launches on a Hopper GPU: tests/gpu/test_pdl_gpu.py."""

from __future__ import annotations

import pytest
import torch

from worker.backends import pdl


@pytest.mark.parametrize("rows", [2, 64, 8192])
def test_steps_of_several_rows_launch_plainly(rows: int) -> None:
    assert pdl.options(torch.device("cuda", 0), rows) == {"PDL": False}


def test_the_cpu_launches_plainly() -> None:
    assert pdl.options(torch.device("cpu"), 1) == {"PDL": False}


def test_switched_off_no_launch_asks_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdl, "enabled", False)
    assert pdl.options(torch.device("cuda", 0), 1) == {"PDL": False}
