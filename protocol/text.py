"""How a stream of wire token ids becomes text: incremental detokenization and
stop strings. The gateway runs it on the results from its workers; the
in-process `LLM` (clients/llm.py) on its executor's results, converted to the
wire's `Result`: one code path, so both show the same text.

Text that might be the start of a stop string is held back until the next
tokens settle it, so a reader never receives text a stop string later cuts.
When a stop string ends a sequence the tokens of that step are still reported
(they were produced); the text stops right before the stop string.

Of what lies outside the standard library this imports only `tokenizers`; it
is not imported by `protocol/__init__.py`, so the client library stays free
of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from protocol.results import FinishReason, Result


class IncrementalDetokenizer:
    """Byte-level BPE splits a multi-byte character across tokens, and decoding one
    token alone can drop or change leading spaces. tokenizers' `DecodeStream`
    handles both in one native call per token (it re-decodes a short window of
    recent tokens and holds back a character whose remaining bytes are still to
    come); this class keeps the text so far, for stop strings, and can flush what
    is still held back when a stream ends."""

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


class SequenceText:
    """One sequence's text as its tokens arrive, cut at the first stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = [s for s in stop if s]
        self._longest = max(map(len, self.stop), default=0)
        self.sent = 0  # characters of detok.text already handed out

    def add(self, token_ids: list[int], final: bool) -> tuple[str, bool]:
        """The text these tokens settle, and whether a stop string ended the
        sequence (the text then stops right before it)."""
        self.detok.add(token_ids)
        if final:
            self.detok.flush()
        text = self.detok.text
        if self.stop:
            start = max(0, self.sent - self._longest + 1)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                end = max(min(hits), self.sent)
                out, self.sent = text[self.sent : end], end
                return out, True
            if not final:
                safe = max(self.sent, len(text) - self._longest + 1)
                out, self.sent = text[self.sent : safe], safe
                return out, False
        out, self.sent = text[self.sent :], len(text)
        return out, False


@dataclass(slots=True)
class _Sequence:
    text: SequenceText | None
    finished: bool = False


@dataclass(slots=True)
class OutputStream:
    """One request's output as its reader sees it: each result's text filled in,
    stop strings applied, results after the end dropped."""

    tokenizer: Tokenizer | None  # None: tokens pass through without text
    stop: list[str]
    num_sequences: int
    beam_search: bool = False
    finished: bool = False  # the reader got its final result
    num_tokens: int = 0
    _seqs: dict[int, _Sequence] = field(default_factory=dict)

    def apply(self, result: Result) -> Result | None:
        """Fill in the text of a result (in place: the caller owns it) and apply
        stop strings. None when there is nothing to pass on (a sequence already
        ended by a stop string). Sets `finished`."""
        if self.finished:
            return None
        seq = self._seqs.get(result.sequence_index)
        if seq is None:
            seq_text = None if self.tokenizer is None else SequenceText(self.tokenizer, self.stop)
            seq = self._seqs[result.sequence_index] = _Sequence(seq_text)
        if seq.finished:
            if not result.is_final:
                return None
            self.finished = True
            result.output_token_ids = [[]]
            result.text = None
            return result
        if self.beam_search:
            # Beams come whole (the running ones while streaming, the best finished
            # ones at the end), so their text is decoded whole too; stop strings do
            # not apply to beam search.
            self.num_tokens = max(len(t) for t in result.output_token_ids)
            if self.tokenizer is not None:
                result.text = [self.tokenizer.decode(t, skip_special_tokens=True) for t in result.output_token_ids]
            self.finished = result.is_final
            return result
        self.num_tokens += sum(len(t) for t in result.output_token_ids)
        if seq.text is not None and len(result.output_token_ids) == 1:
            text, stopped = seq.text.add(result.output_token_ids[0], result.is_sequence_final)
            result.text = [text]
            if stopped:
                seq.finished = True
                done = sum(s.finished for s in self._seqs.values())
                result.is_sequence_final = True
                result.finish_reasons = [FinishReason.STOP_WORDS]
                result.is_final = result.is_final or done == self.num_sequences
        if result.is_sequence_final:
            seq.finished = True
        self.finished = result.is_final
        return result

    def whole_text(self, index: int = 0) -> str:
        """All the text sequence `index` has handed out so far."""
        seq = self._seqs.get(index)
        if seq is None or seq.text is None:
            return ""
        return seq.text.detok.text[: seq.text.sent]

    def resume(self, token_ids: list[int]) -> None:
        """Take in tokens its reader received from an earlier run (a continuation,
        protocol/continuation.py): their text is not passed on again, but the text and
        stop strings of the tokens after them follow from them."""
        self.apply_tokens(list(token_ids))

    def apply_tokens(self, token_ids: list[int]) -> str | Result | None:
        """`apply` for a plain streamed step (sequence 0's next tokens, one beam, not
        final: what protocol.StreamedTokens carries) without building a Result for
        it: the text the tokens add. Where a Result is needed (the sequence's first
        step, beam search, stop strings) it goes through `apply`: its Result or None."""
        seq = self._seqs.get(0)
        if seq is None or seq.finished or self.finished or self.beam_search or self.stop:
            result = Result(is_final=False, output_token_ids=[token_ids], finish_reasons=[FinishReason.NOT_FINISHED])
            return self.apply(result)
        self.num_tokens += len(token_ids)
        if seq.text is None:
            return ""
        text = seq.text.detok.add(token_ids)  # with no stop strings nothing is held back
        seq.text.sent += len(text)
        return text
