"""Tokenizers by model name, loaded once from the checkpoints the gateway is told
about (weights are never read)."""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import Tokenizer

log = logging.getLogger(__name__)


def model_name_of(path: Path) -> str:
    """The name a worker serves a checkpoint under (worker/service/__main__.py agrees)."""
    return path.stem if path.suffix == ".gguf" else path.name


class Tokenizers:
    def __init__(self, models: list[str]) -> None:
        """`models`: checkpoint directories, .gguf files or the default model's name."""
        self._by_name: dict[str, Tokenizer] = {}
        for model in models:
            self.load(model)

    def load(self, model: str) -> str:
        from worker.models.loader import load_model

        path = Path(model)
        if not path.exists():
            from worker.models.default_model import resolve_model

            path = resolve_model(model)
        loaded = load_model(path, load_weights=False)
        name = model_name_of(path)
        self._by_name[name] = loaded.tokenizer
        log.info("tokenizer for %s loaded from %s", name, path)
        return name

    def get(self, model: str) -> Tokenizer | None:
        return self._by_name.get(model)

    def names(self) -> list[str]:
        return list(self._by_name)
