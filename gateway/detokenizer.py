"""Incremental detokenization for streams.

Byte-level BPE splits a multi-byte character across tokens, and decoding one token
alone can drop or change leading spaces. tokenizers' `DecodeStream` handles both in
one native call per token (it re-decodes a short window of recent tokens and holds
back a character whose remaining bytes are still to come); this class keeps the text
so far, for stop strings, and can flush what is still held back when a stream ends.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []  # tokens whose text is not complete yet

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the text they complete (maybe empty)."""
        pieces = []
        for token in new_ids:
            piece = self._stream.step(self.tokenizer, token)
            if piece is None:
                self._held.append(token)
            else:
                self._held.clear()
                pieces.append(piece)
        delta = "".join(pieces)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a stream: the text of the tokens still held back, an incomplete
        character included (as U+FFFD)."""
        rest = self.tokenizer.decode(self._held, skip_special_tokens=self.skip_special_tokens) if self._held else ""
        self._held.clear()
        self.text += rest
        return rest
