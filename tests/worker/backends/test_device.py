"""Backend auto-selection: torch on CUDA when there is a GPU, else numpy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.backends.device import create_backend, describe, resolve_backend
from worker.models.loader import load_model


def test_auto_picks_by_cuda_presence() -> None:
    assert resolve_backend("auto") == ("torch" if torch.cuda.is_available() else "numpy")
    assert resolve_backend("numpy") == "numpy"
    assert resolve_backend("torch") == "torch"


def test_unknown_choice_is_named() -> None:
    with pytest.raises(ValueError, match="'tpu'"):
        resolve_backend("tpu")


def test_create_and_describe(tiny_llama: Path) -> None:
    model = load_model(tiny_llama)
    numpy_backend = create_backend(model, "numpy")
    assert describe(numpy_backend) == {"backend": "numpy", "device": "cpu", "dtype": "float32"}
    torch_backend = create_backend(model, "torch", device="cpu")
    assert describe(torch_backend) == {"backend": "torch-cpu", "device": "cpu", "dtype": "float32"}
    with pytest.raises(ValueError, match="CPU only"):
        create_backend(model, "numpy", device="cuda")
