"""One entry point for every checkpoint format."""

from __future__ import annotations

from pathlib import Path

from worker.models.config import CheckpointError
from worker.models.hf_checkpoint import load_hf_checkpoint
from worker.models.loaded_model import LoadedModel


def load_model(path: str | Path, load_weights: bool = True) -> LoadedModel:
    """Load a Hugging Face checkpoint directory or a .gguf file.

    With load_weights=False the tensors are only located and shape-checked
    (LoadedModel.tensor_refs), for a backend that reads them itself.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from worker.models.gguf_loader import load_gguf

        return load_gguf(path)
    if path.is_dir():
        return load_hf_checkpoint(path, load_weights=load_weights)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory or .gguf file")
    raise CheckpointError(f"{path}: not a checkpoint directory or a .gguf file")
