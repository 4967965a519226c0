"""Decoder-only language models: the one model definition (llama.py), the families it
runs (families/: Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text, Phi-3), the
loaders for Hugging Face checkpoints and GGUF files, and the default model."""

from worker.models.config import CheckpointError, ModelConfig
from worker.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model, resolve_model
from worker.models.loaded_model import LoadedModel
from worker.models.loader import load_model

__all__ = [
    "DEFAULT_MODEL_NAME",
    "CheckpointError",
    "LoadedModel",
    "ModelConfig",
    "ensure_default_model",
    "load_model",
    "resolve_model",
]
