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
        self._failed: set[str] = set()
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
        """The tokenizer for `model`; the embedded default model's is loaded on first
        use even without --model (other names only from the paths given)."""
        found = self._by_name.get(model)
        if found is None and model not in self._failed:
            from worker.models.default_model import DEFAULT_MODEL_ALIASES

            if model in DEFAULT_MODEL_ALIASES:
                try:
                    self.load(model)
                except Exception as e:  # not cached and no network: text prompts get a clear error
                    log.warning("no tokenizer for %s: %s", model, e)
                    self._failed.add(model)
            found = self._by_name.get(model)
        return found

    def names(self) -> list[str]:
        return list(self._by_name)
