"""Incremental detokenization for streams.

Byte-level BPE splits a multi-byte character across tokens, and decoding one
token alone can drop or change leading spaces. So each step re-decodes a short
window of recent tokens and emits only text that is complete: never a trailing
U+FFFD, which stands for a character whose remaining bytes are still to come.
"""

from __future__ import annotations

from tokenizers import Tokenizer

# Tokens of context kept before the unread ones; enough for any merge to settle.
_WINDOW = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text is already in self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the text they complete (maybe empty)."""
        self.token_ids.extend(new_ids)
        window = self.token_ids[self._prefix :]
        before = self._decode(self.token_ids[self._prefix : self._read])
        now = self._decode(window)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        delta = now[len(before) :]
        self.text += delta
        self._read = len(self.token_ids)
        self._prefix = max(0, self._read - _WINDOW)
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever is left, replacement characters included."""
        done = self._decode(self.token_ids[self._prefix : self._read])
        rest = self._decode(self.token_ids[self._prefix :])[len(done) :]
        self.text += rest
        self._read = len(self.token_ids)
        return rest
