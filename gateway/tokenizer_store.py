"""Tokenizers by model name, as the workers serving each model sent them in their
Ready: a gateway needs no checkpoint files of its own."""

from __future__ import annotations

import hashlib
import logging

from tokenizers import Tokenizer

log = logging.getLogger(__name__)


class Tokenizers:
    def __init__(self) -> None:
        self._by_name: dict[str, Tokenizer] = {}
        self._digests: dict[str, bytes] = {}

    def add(self, model: str, tokenizer_json: bytes) -> None:
        """Keep `model`'s tokenizer; parsed once, however many workers send the same one."""
        digest = hashlib.sha256(tokenizer_json).digest()
        known = self._digests.get(model)
        if known == digest:
            return
        try:
            tokenizer = Tokenizer.from_str(tokenizer_json.decode())
        except Exception as e:  # a worker's bug must not stop the gateway
            log.error("the tokenizer a worker sent for %s does not load: %s", model, e)
            return
        if known is not None:
            log.warning("workers of %s sent different tokenizers; the latest one is used", model)
        self._by_name[model] = tokenizer
        self._digests[model] = digest
        log.info("tokenizer for %s received", model)

    def get(self, model: str) -> Tokenizer | None:
        return self._by_name.get(model)
