"""How a checkpoint pools its hidden states into one embedding.

A sentence-transformers checkpoint says it in `modules.json` (the pipeline of
modules, one of type `sentence_transformers.models.Pooling` with its folder) and
that folder's `config.json` (`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`,
...). Without one, "last": decoder-only embedding models (Qwen3-Embedding,
e5-mistral) are trained to put the sequence's meaning in its last token's state,
the only one that has attended to every other token.
"""

from __future__ import annotations

import json
from pathlib import Path

POOLINGS = ("last", "mean")
DEFAULT_POOLING = "last"

# sentence-transformers' pooling modes, by the names this engine uses.
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


def checkpoint_pooling(path: Path) -> str:
    """The pooling `path` (a checkpoint directory) declares, else DEFAULT_POOLING. A mode
    other than last-token or mean (CLS, max, weighted mean) comes back by its
    sentence-transformers name, so embedding requests that rely on it are refused rather
    than answered with vectors the model was not trained to make; generation is
    unaffected."""
    modules_file = path / "modules.json"
    if not path.is_dir() or not modules_file.is_file():
        return DEFAULT_POOLING
    modules = json.loads(modules_file.read_text())
    folder = next((m.get("path") for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    config_file = path / str(folder) / "config.json"
    if folder is None or not config_file.is_file():
        return DEFAULT_POOLING
    config = json.loads(config_file.read_text())
    declared = [key for key, value in config.items() if key.startswith("pooling_mode_") and value is True]
    if len(declared) != 1:
        return "+".join(declared) or DEFAULT_POOLING
    return _MODES.get(declared[0], declared[0])
