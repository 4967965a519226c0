"""Where the LLM's model comes from: a local checkpoint directory or .gguf file,
the default model's name, or a Hugging Face hub id ("Qwen/Qwen2.5-0.5B-Instruct"),
resolved through huggingface_hub: the local cache first, then a download (with
its progress bar) where the network allows, else an error naming the id.

The cache is the one the environment names when the call is made (HF_HUB_CACHE,
else HF_HOME/hub), and HF_HUB_OFFLINE=1 rules the download out.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# owner/name, as the hub spells repository ids
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a checkpoint directory needs: config, weights, tokenizer.
_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model"]


class ModelNotFoundError(FileNotFoundError):
    """No local checkpoint, and no hub snapshot to be had; the message names the model."""


def resolve_source(model: str | Path) -> Path:
    """A local path for `model` (see the module docstring)."""
    from worker.models.default_model import DEFAULT_MODEL_ALIASES, resolve_model

    text = str(model)
    if text in DEFAULT_MODEL_ALIASES or Path(text).expanduser().exists() or not _HUB_ID.match(text):
        return resolve_model(model)
    return hub_snapshot(text)


def hub_cache_dir() -> Path:
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot of a hub model: cached, else downloaded."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local checkpoint, and reading it from the Hugging Face hub needs "
            "huggingface_hub (pip install huggingface_hub)") from None
    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True, allow_patterns=_PATTERNS))
    except Exception:  # not cached (huggingface_hub raises several types for that)
        pass
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ModelNotFoundError(
            f"{repo_id!r} is not in the Hugging Face cache at {cache}, and HF_HUB_OFFLINE forbids downloading it")
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=_PATTERNS))
    except Exception as e:
        raise ModelNotFoundError(
            f"{repo_id!r} is not in the Hugging Face cache at {cache} and could not be downloaded: "
            f"{type(e).__name__}: {e}") from None
