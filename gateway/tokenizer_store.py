"""Tokenizers by model name, as the workers serving each model sent them in their
Ready: a gateway needs no checkpoint files of its own.

The first tokenizer held for a model (or the SHA-256 pinned for it in config) is
the model's: a worker sending a different one is refused, so no worker, however it
got into the registry, changes how a gateway reads every other worker's prompts.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping

from tokenizers import Tokenizer

log = logging.getLogger(__name__)


class Tokenizers:
    def __init__(self, pinned: Mapping[str, str] | None = None) -> None:
        self._by_name: dict[str, Tokenizer] = {}
        self._longest: dict[str, int] = {}  # bytes of each model's longest token
        self._digests: dict[str, str] = {name: digest.lower() for name, digest in (pinned or {}).items()}

    def add(self, model: str, tokenizer_json: bytes, sender: str = "a worker") -> bool:
        """Keep `model`'s tokenizer (parsed once, however many workers send the same
        one); False if it is refused: different from the one held or pinned, or broken."""
        digest = hashlib.sha256(tokenizer_json).hexdigest()
        known = self._digests.get(model)
        if known == digest and model in self._by_name:
            return True
        if known is not None and known != digest:
            log.error(
                "%s sent a tokenizer for %s (sha256 %s) that differs from the one %s (sha256 %s): refused",
                sender, model, digest[:16], "held" if model in self._by_name else "pinned in config", known[:16],
            )  # fmt: skip
            return False
        try:
            tokenizer = Tokenizer.from_str(tokenizer_json.decode())
        except Exception as e:  # a worker's bug must not stop the gateway
            log.error("the tokenizer %s sent for %s does not load: %s", sender, model, e)
            return False
        self._by_name[model] = tokenizer
        self._longest[model] = max((len(t.encode()) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)
        self._digests[model] = digest
        log.info("tokenizer for %s received (sha256 %s)", model, digest[:16])
        return True

    def get(self, model: str) -> Tokenizer | None:
        return self._by_name.get(model)

    def too_long(self, model: str, text: str, max_tokens: int) -> bool:
        """Whether `text` surely encodes to more than `max_tokens` tokens, told without
        encoding it: no token stands for more characters than its vocabulary string has bytes."""
        return len(text) > max_tokens * self._longest.get(model, len(text))
