"""One entry point for every checkpoint format."""

from __future__ import annotations

from pathlib import Path

from worker.models.config import CheckpointError
from worker.models.hf_checkpoint import load_hf_checkpoint
from worker.models.loaded_model import LoadedModel
from worker.models.quantization import check_mode


def load_model(path: str | Path, load_weights: bool = True, quantization: str | None = None) -> LoadedModel:
    """Load a Hugging Face checkpoint directory or a .gguf file.

    With load_weights=False the tensors are only located and shape-checked
    (LoadedModel.tensor_refs), for a backend that reads them itself. `quantization`
    ("fp8" | "int4") has the backend quantize the float weights as it builds the model.
    """
    check_mode(quantization)
    model = _load(Path(path), load_weights)
    if quantization is not None:
        if model.quantization is not None:
            raise CheckpointError(f"{path}: already quantized ({model.quantization}); drop --quantization")
        model.quantize = quantization
        model.quantization = f"{quantization} (quantized on load{', int4 RTN' if quantization == 'int4' else ''})"
    return model


def _load(path: Path, load_weights: bool) -> LoadedModel:
    if path.is_file() and path.suffix == ".gguf":
        from worker.models.gguf_loader import load_gguf

        return load_gguf(path)
    if path.is_dir():
        return load_hf_checkpoint(path, load_weights=load_weights)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory or .gguf file")
    raise CheckpointError(f"{path}: not a checkpoint directory or a .gguf file")
