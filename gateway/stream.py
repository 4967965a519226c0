"""One request's output as its client sees it: tokens turned into text
incrementally, and stop strings, which only the decoded text can show.

Text that might be the start of a stop string is held back until the next
tokens settle it, so a client never receives text a stop string later cuts.
When a stop string ends a sequence the tokens of that step are still reported
(the worker produced them); the text stops right before the stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

import protocol
from gateway.detokenizer import IncrementalDetokenizer
from protocol import FinishReason


@dataclass(slots=True)
class _Sequence:
    detok: IncrementalDetokenizer | None
    sent: int = 0  # characters of detok.text already sent
    finished: bool = False


@dataclass(slots=True)
class OutputStream:
    tokenizer: Tokenizer | None
    stop: list[str]
    num_sequences: int
    beam_search: bool = False
    finished: bool = False  # the client got its final response
    num_tokens: int = 0
    _seqs: dict[int, _Sequence] = field(default_factory=dict)

    def apply(self, result: protocol.Result) -> protocol.Result | None:
        """Fill in the text of a result from the worker (in place: the gateway owns
        it) and apply stop strings. None when there is nothing to send (a sequence
        already ended by a stop string). Sets `finished`."""
        if self.finished:
            return None
        seq = self._seqs.get(result.sequence_index)
        if seq is None:
            detok = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer)
            seq = self._seqs[result.sequence_index] = _Sequence(detok)
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
        if seq.detok is not None and len(result.output_token_ids) == 1:
            text, stopped = self._text(seq, result.output_token_ids[0], result.is_sequence_final)
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

    def apply_tokens(self, token_ids: list[int]) -> str | protocol.Result | None:
        """`apply` for a plain streamed step (sequence 0's next tokens, one beam, not
        final: what protocol.StreamedTokens carries) without building a Result for
        it: the text the tokens add. Where a Result is needed (the sequence's first
        step, beam search, stop strings) it goes through `apply`: its Result or None."""
        seq = self._seqs.get(0)
        if seq is None or seq.finished or self.finished or self.beam_search or self.stop:
            result = protocol.Result(
                is_final=False, output_token_ids=[token_ids], finish_reasons=[FinishReason.NOT_FINISHED]
            )
            return self.apply(result)
        self.num_tokens += len(token_ids)
        if seq.detok is None:
            return ""
        text = seq.detok.add(token_ids)  # with no stop strings nothing is held back (as in _text)
        seq.sent += len(text)
        return text

    def _text(self, seq: _Sequence, token_ids: list[int], final: bool) -> tuple[str, bool]:
        assert seq.detok is not None
        seq.detok.add(token_ids)
        if final:
            seq.detok.flush()
        text = seq.detok.text
        if self.stop:
            longest = max(map(len, self.stop))
            start = max(0, seq.sent - longest + 1)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                end = max(min(hits), seq.sent)
                out, seq.sent = text[seq.sent : end], end
                return out, True
            if not final:
                safe = max(seq.sent, len(text) - longest + 1)
                out, seq.sent = text[seq.sent : safe], safe
                return out, False
        out, seq.sent = text[seq.sent :], len(text)
        return out, False
