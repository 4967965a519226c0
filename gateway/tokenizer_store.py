"""Tokenizers and chat templates by model name, as the workers serving each model
sent them in their Ready: a gateway needs no checkpoint files of its own."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from tokenizers import Tokenizer

import protocol
from protocol.chat_template import ChatTemplateError, render_chat

log = logging.getLogger(__name__)


class Tokenizers:
    def __init__(self) -> None:
        self._by_name: dict[str, Tokenizer] = {}
        self._digests: dict[str, bytes] = {}
        self._chat: dict[str, protocol.Ready] = {}  # the Ready that brought the model's chat template

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

    def add_chat(self, model: str, ready: protocol.Ready) -> None:
        """Keep the chat template (and its special tokens) of a worker's Ready."""
        if ready.chat_template is not None:
            self._chat[model] = ready

    def render_chat(self, model: str | None, messages: Iterable[Mapping[str, Any]]) -> str:
        """`messages` as `model`'s prompt text; ChatTemplateError if it cannot be made."""
        ready = self._chat.get(model) if model is not None else None
        if ready is None:
            raise ChatTemplateError(f"model {model!r} has no chat template (its worker sent none): send a prompt")
        return render_chat(ready.chat_template, messages, bos_token=ready.bos_token, eos_token=ready.eos_token)
