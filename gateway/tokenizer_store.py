"""Tokenizers and chat templates by model name, as the workers serving each model
sent them in their Ready: a gateway needs no checkpoint files of its own.

The first tokenizer held for a model (or the SHA-256 pinned for it in config) is
the model's: a worker sending a different one is refused, so no worker, however it
got into the registry, changes how a gateway reads every other worker's prompts.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from tokenizers import Tokenizer

import protocol
from protocol.chat_template import ChatTemplateError, render_chat

log = logging.getLogger(__name__)


class PromptError(ValueError):
    """A prompt that cannot become token ids; the text says why."""


class Tokenizers:
    def __init__(self, pinned: Mapping[str, str] | None = None) -> None:
        self._by_name: dict[str, Tokenizer] = {}
        self._longest: dict[str, int] = {}  # bytes of each model's longest token
        self._digests: dict[str, str] = {name: digest.lower() for name, digest in (pinned or {}).items()}
        self._chat: dict[str, protocol.Ready] = {}  # the Ready that brought the model's chat template

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

    def prompt_ids(self, model: str | None, prompt: str | None, messages: Iterable[Mapping[str, Any]] | None,
                   max_seq_len: int | None, template_extra: Mapping[str, Any] | None = None) -> list[int]:  # fmt: skip
        """The token ids of a text prompt, or of a chat rendered with `model`'s template;
        PromptError (or ChatTemplateError) saying what is wrong. Any thread may call it:
        it only reads, and the encoding releases the GIL."""
        tokenizer = self.get(model) if model is not None else None
        if tokenizer is None or model is None:
            raise PromptError(f"no tokenizer for model {model!r} (its worker sent none): send input_token_ids")
        # A chat's text is the template's, special tokens and all.
        text = self.render_chat(model, messages, template_extra) if messages else prompt or ""
        # Refused before it costs seconds of encoding when it cannot fit the context.
        if max_seq_len is not None and self.too_long(model, text, max_seq_len):
            raise PromptError(
                f"the prompt ({len(text)} characters) is longer than any text the model's context of "
                f"{max_seq_len} tokens can hold"
            )
        # encode_batch, not encode: encode holds the GIL for the whole encoding (seconds for MBs of
        # text), which would stall every other thread of the process, the gateway's socket loop first.
        ids: list[int] = tokenizer.encode_batch([text], add_special_tokens=not messages)[0].ids
        if not ids:
            raise PromptError("the prompt encodes to no tokens")
        return ids

    def add_chat(self, model: str, ready: protocol.Ready) -> None:
        """Keep the chat template (and its special tokens) of a worker's Ready."""
        if ready.chat_template is not None:
            self._chat[model] = ready

    def chat_template(self, model: str | None) -> str | None:
        ready = self._chat.get(model) if model is not None else None
        return None if ready is None else ready.chat_template

    def special_tokens(self, model: str) -> tuple[str | None, str | None]:
        """The (bos, eos) tokens the model's chat template is rendered with."""
        ready = self._chat.get(model)
        return (None, None) if ready is None else (ready.bos_token, ready.eos_token)

    def render_chat(self, model: str | None, messages: Iterable[Mapping[str, Any]],
                    extra: Mapping[str, Any] | None = None) -> str:  # fmt: skip
        """`messages` as `model`'s prompt text (`extra`: more template variables);
        ChatTemplateError if it cannot be made."""
        ready = self._chat.get(model) if model is not None else None
        if ready is None:
            raise ChatTemplateError(f"model {model!r} has no chat template (its worker sent none): send a prompt")
        return render_chat(ready.chat_template, messages, bos_token=ready.bos_token, eos_token=ready.eos_token,
                           extra=extra)
