"""What comes back: `Response` / `Result` with the executor's semantics, and the
result batch that carries one iteration's responses for one peer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Self

from pydantic import Field, TypeAdapter, model_validator

from protocol.base import Message, Name, Uint64, WireModel
from protocol.limits import DEFAULT_LIMITS
from protocol.packed import FloatRows, Floats, TokenIdRows, TokenIds
from protocol.records import WorkerLoad
from protocol.status import FinishReason as FinishReason  # its home before protocol.status


class Logits(WireModel):
    """A float32 tensor, row-major, packed little-endian."""

    shape: list[Annotated[int, Field(ge=0)]] = Field(max_length=4)
    data: bytes

    @model_validator(mode="after")
    def _size_matches(self) -> Self:
        expected = 4 * math.prod(self.shape)
        if len(self.data) != expected:
            raise ValueError(f"data is {len(self.data)} bytes; shape {self.shape} needs {expected}")
        return self


class PromptLogProbs(WireModel):
    """Prompt tokens 1 .. P-1: each one's log prob given the tokens before it, and the
    output_config.prompt_log_probs likeliest tokens at its position, most likely first."""

    log_probs: Floats
    top_token_ids: TokenIdRows
    top_log_probs: FloatRows

    @model_validator(mode="after")
    def _one_entry_per_token(self) -> Self:
        if not len(self.log_probs) == len(self.top_token_ids) == len(self.top_log_probs):
            raise ValueError("prompt_log_probs: log_probs, top_token_ids and top_log_probs differ in length")
        return self


class FunctionCall(WireModel):
    """A call the model made to one of a chat's tools: OpenAI's tool_calls entry."""

    id: Name
    name: Name
    arguments: str  # JSON text


class Result(WireModel):
    is_final: bool
    # One list per beam (a single list when beam_width == 1).
    output_token_ids: list[TokenIds] = Field(min_length=1)
    finish_reasons: list[Annotated[FinishReason, Field(strict=False)]]
    sequence_index: int = Field(0, ge=0)
    is_sequence_final: bool = False
    cum_log_probs: list[Annotated[float, Field(allow_inf_nan=True)]] | None = None
    log_probs: list[Floats] | None = None
    # Per beam, per generated token: the output_config.top_n_log_probs most likely
    # tokens, most likely first, and their log probs.
    top_token_ids: list[TokenIdRows] | None = None
    top_log_probs: list[FloatRows] | None = None
    context_logits: Logits | None = None  # [prompt_len, vocab]
    generation_logits: Logits | None = None  # [beams, new_tokens, vocab]
    prompt_log_probs: PromptLogProbs | None = None  # in a final result, when asked for
    embedding: Logits | None = None  # [hidden], unit L2 norm: a request with embedding_config
    # Filled by the gateway: the text these tokens add, one string per beam.
    text: list[str] | None = None
    # Filled by the gateway in a chat's final result when it was given tools: the calls
    # read from the whole output (protocol/tool_calls.py); then, unless it streamed, the
    # final text is the output's content outside the calls.
    tool_calls: list[FunctionCall] | None = None

    @model_validator(mode="after")
    def _one_entry_per_beam(self) -> Self:
        # Written out rather than looped over field names: this runs for every
        # result of every batch.
        beams = len(self.output_token_ids)
        if len(self.finish_reasons) != beams:
            _beam_mismatch("finish_reasons", self.finish_reasons, beams)
        if self.cum_log_probs is not None and len(self.cum_log_probs) != beams:
            _beam_mismatch("cum_log_probs", self.cum_log_probs, beams)
        if self.log_probs is not None and len(self.log_probs) != beams:
            _beam_mismatch("log_probs", self.log_probs, beams)
        if self.top_token_ids is not None and len(self.top_token_ids) != beams:
            _beam_mismatch("top_token_ids", self.top_token_ids, beams)
        if self.top_log_probs is not None and len(self.top_log_probs) != beams:
            _beam_mismatch("top_log_probs", self.top_log_probs, beams)
        if self.text is not None and len(self.text) != beams:
            _beam_mismatch("text", self.text, beams)
        return self


def _beam_mismatch(name: str, value: list[Any], beams: int) -> None:
    raise ValueError(f"{name} has {len(value)} entries; output_token_ids has {beams} beams")


class Response(WireModel):
    """One request's news: a `Result` or an error (an error is final)."""

    request_id: Name
    result: Result | None = None
    error_msg: str | None = None
    client_id: Uint64 | None = None

    @model_validator(mode="after")
    def _one_of(self) -> Self:
        if (self.result is None) == (self.error_msg is None):
            raise ValueError("exactly one of result and error_msg must be given")
        return self

    @property
    def has_error(self) -> bool:
        return self.error_msg is not None

    @property
    def is_final(self) -> bool:
        return self.result is None or self.result.is_final


class StreamedTokens(WireModel):
    """Streamed steps in columns: entry i says request `request_ids[i]` produced the
    next `counts[i]` of `token_ids`. Each stands for a Response whose result is
    not final, is sequence 0's, carries no client id and holds tokens alone: what
    almost every message of a streaming worker is. A worker builds three arrays
    per step for its 64 streams several times faster than 64 Responses, and that
    work shares the executor's GIL; a gateway forwards each client its entries
    the same way, with `text`, and never builds a model per token."""

    request_ids: list[Name] = Field(max_length=DEFAULT_LIMITS.max_array_len)
    counts: TokenIds
    token_ids: TokenIds
    # Filled by the gateway: the text entry i's tokens add (its Result's `text`).
    text: list[str] | None = Field(None, max_length=DEFAULT_LIMITS.max_array_len)

    @model_validator(mode="after")
    def _columns_agree(self) -> Self:
        if len(self.counts) != len(self.request_ids):
            raise ValueError(f"{len(self.counts)} counts for {len(self.request_ids)} request ids")
        if 0 in self.counts:
            raise ValueError("a streamed step carries at least one token")
        if sum(self.counts) != len(self.token_ids):
            raise ValueError(f"counts add up to {sum(self.counts)} tokens; token_ids has {len(self.token_ids)}")
        if self.text is not None and len(self.text) != len(self.request_ids):
            raise ValueError(f"{len(self.text)} texts for {len(self.request_ids)} request ids")
        return self

    def responses(self) -> list[Response]:
        """The Responses these columns stand for."""
        items = []
        start = 0
        texts: Sequence[str | None] = self.text if self.text is not None else [None] * len(self.request_ids)
        not_finished = [FinishReason.NOT_FINISHED]
        for request_id, n, text in zip(self.request_ids, self.counts, texts, strict=True):
            result = {"is_final": False, "output_token_ids": [self.token_ids[start : start + n]],
                      "finish_reasons": not_finished, "text": None if text is None else [text]}  # fmt: skip
            items.append({"request_id": request_id, "result": result})
            start += n
        # One validation of them all costs less than a constructor call each (and
        # model_construct, in pydantic 2, costs more than either).
        return _RESPONSES.validate_python(items)


_RESPONSES = TypeAdapter(list[Response])


class ResultBatch(Message):
    """The responses of one executor iteration for one peer, and the sender's load
    (what gateways route on). `streamed` holds the plain streamed steps in columns
    (workers send them so); they happened before anything in `responses`."""

    kind: ClassVar[str] = "results"

    responses: list[Response] = Field(default_factory=list, max_length=DEFAULT_LIMITS.max_array_len)
    streamed: StreamedTokens | None = None
    load: WorkerLoad | None = None

    def all_responses(self) -> list[Response]:
        """Every response of the batch, the streamed steps first, in the order they happened."""
        if self.streamed is None:
            return self.responses
        return self.streamed.responses() + self.responses
