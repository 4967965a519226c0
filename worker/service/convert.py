"""Wire models (protocol) to the executor's dataclasses and back; one gateway's share of a step."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

import protocol
from protocol.limits import Limits
from protocol.packed import WIRE_CONTEXT, pack_ints
from worker.executor import types as ex


def to_request(msg: protocol.Submit) -> ex.Request:
    """A validated submit carrying token ids (workers do not tokenize)."""
    assert msg.input_token_ids is not None
    guided = msg.guided_decoding_params
    return ex.Request(
        input_token_ids=list(msg.input_token_ids),
        max_tokens=msg.max_tokens,
        streaming=msg.streaming,
        sampling_config=ex.SamplingConfig(**msg.sampling_config.model_dump()),
        output_config=ex.OutputConfig(**msg.output_config.model_dump()),
        end_id=msg.end_id,
        pad_id=msg.pad_id,
        bad_words=msg.bad_words,
        stop_words=msg.stop_words,
        embedding_bias=msg.embedding_bias,
        client_id=msg.client_id,
        priority=msg.priority,
        num_return_sequences=msg.num_return_sequences,
        return_all_generated_tokens=msg.return_all_generated_tokens,
        logits_post_processor_name=msg.logits_post_processor_name,
        guided_decoding_params=None if guided is None else ex.GuidedDecodingParams(guided.guide_type, guided.guide),
        speculative_config=None if msg.speculative_config is None else _speculative(msg.speculative_config),
        lora_config=None if msg.lora_config is None else ex.LoraConfig(msg.lora_config.name),
        prompt_tuning_config=None if msg.prompt_tuning_config is None else _prompt_table(msg.prompt_tuning_config),
        resumed_token_ids=None if msg.resumed_token_ids is None else list(msg.resumed_token_ids),
        embedding_config=None if msg.embedding_config is None else ex.EmbeddingConfig(msg.embedding_config.pooling),
    )


def _prompt_table(cfg: protocol.PromptTuningConfig) -> ex.PromptTuningConfig:
    table = cfg.embedding_table
    rows = np.frombuffer(table.data, dtype="<f4").reshape(table.shape).astype(np.float32)  # a writable native copy
    return ex.PromptTuningConfig(rows)


def _speculative(cfg: protocol.SpeculativeConfig) -> ex.SpeculativeConfig:
    fields = cfg.model_dump()
    fields["draft_tokens"] = None if cfg.draft_tokens is None else list(cfg.draft_tokens)
    return ex.SpeculativeConfig(**{**fields, "source": ex.DraftSource(cfg.source)})


def to_wire_result(r: ex.Result) -> protocol.Result:
    """The executor's result in the wire's shape, built without validation
    (model_construct): it is the executor's own output (the worker's pump, and the
    in-process LLM's text path); a gateway validates what it receives."""
    return protocol.Result.model_construct(
        is_final=r.is_final,
        output_token_ids=r.output_token_ids,
        finish_reasons=[protocol.FinishReason(int(f)) for f in r.finish_reasons],
        sequence_index=r.sequence_index,
        is_sequence_final=r.is_sequence_final,
        cum_log_probs=r.cum_log_probs,
        log_probs=r.log_probs,
        top_token_ids=r.top_token_ids,
        top_log_probs=r.top_log_probs,
        context_logits=_logits(r.context_logits),
        generation_logits=_logits(r.generation_logits),
        prompt_log_probs=_prompt_log_probs(r.prompt_log_probs),
        embedding=_logits(r.embedding),
        text=None,
    )


def _prompt_log_probs(p: ex.PromptLogProbs | None) -> protocol.PromptLogProbs | None:
    if p is None:
        return None
    return protocol.PromptLogProbs.model_construct(log_probs=p.log_probs, top_token_ids=p.top_token_ids,
                                                   top_log_probs=p.top_log_probs)


def to_wire_response(request_id: str, response: ex.Response) -> protocol.Response:
    if response.error_msg is not None:
        return protocol.Response(request_id=request_id, error_msg=response.error_msg, client_id=response.client_id)
    assert response.result is not None
    return protocol.Response.model_construct(
        request_id=request_id, result=to_wire_result(response.result), error_msg=None, client_id=response.client_id
    )


class WireBatch:
    """One gateway's share of a step, built as the wire wants it: the core's plain
    streamed steps in columns (protocol.StreamedTokens), every other response whole."""

    __slots__ = ("counts", "request_ids", "response_ids", "responses", "token_ids")

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.counts: list[int] = []
        self.token_ids: list[int] = []
        self.responses: list[dict[str, Any]] = []
        self.response_ids: list[str] = []  # the request of each of `responses`

    def add(self, request_id: str, response: ex.Response) -> protocol.Response:
        """A response whole; what it is on the wire."""
        wire = to_wire_response(request_id, response)
        self.response_ids.append(request_id)
        self.responses.append(wire.model_dump(context=WIRE_CONTEXT, exclude_defaults=True))
        return wire

    def add_streamed(self, request_id: str, tokens: list[int]) -> None:
        """A plain streamed step's tokens (a column of the core's StepOutput)."""
        self.request_ids.append(request_id)
        self.counts.append(len(tokens))
        self.token_ids += tokens

    def messages(self, load: dict[str, Any], limits: Limits) -> tuple[list[bytes], dict[str, protocol.Response]]:
        """The encoded ResultBatch messages, and the responses that could not be one
        (over the message limit alone), each sent as an error response for its request.
        Together over the limit, the columns and every response go in messages of their own:
        one request's large result never costs another's tokens."""
        try:
            return [_encode(p, limits) for p in self.payloads(load, limits.max_array_len)], {}
        except protocol.ProtocolError:
            pass
        columns = WireBatch()
        columns.request_ids, columns.counts, columns.token_ids = self.request_ids, self.counts, self.token_ids
        messages = [_encode(p, limits) for p in columns.payloads(load, limits.max_array_len)] if self.counts else []
        unsent: dict[str, protocol.Response] = {}
        for request_id, response in zip(self.response_ids, self.responses, strict=True):
            try:
                messages.append(_encode(_batch_payload([], [], [], [response], load), limits))
            except protocol.ProtocolError as e:
                error = protocol.Response(request_id=request_id, error_msg=f"the result could not be sent: {e}")
                unsent[request_id] = error
                wire = error.model_dump(context=WIRE_CONTEXT, exclude_defaults=True)
                messages.append(_encode(_batch_payload([], [], [], [wire], load), limits))
        return messages, unsent

    def payloads(self, load: dict[str, Any], max_array_len: int) -> Iterator[dict[str, Any]]:
        """ResultBatch payloads (what protocol.encode makes of the model), as many as
        max_array_len needs. A request's streamed steps precede its other responses
        (they did), so split batches send every column first."""
        n, step = len(self.request_ids), max_array_len
        if n <= step and len(self.responses) <= step:
            yield _batch_payload(self.request_ids, self.counts, self.token_ids, self.responses, load)
            return
        ends = list(itertools.accumulate(self.counts))
        for a in range(0, n, step):
            b = min(n, a + step)
            tokens = self.token_ids[ends[a - 1] if a else 0 : ends[b - 1]]
            yield _batch_payload(self.request_ids[a:b], self.counts[a:b], tokens, [], load)
        for a in range(0, len(self.responses), step):
            yield _batch_payload([], [], [], self.responses[a : a + step], load)


def _encode(payload: dict[str, Any], limits: Limits) -> bytes:
    return protocol.encode_payload(protocol.ResultBatch.kind, payload, limits)


def _batch_payload(
    request_ids: list[str], counts: list[int], token_ids: list[int], responses: list[dict[str, Any]],
    load: dict[str, Any],
) -> dict[str, Any]:
    # Field order and the defaults left out follow protocol.ResultBatch.
    payload: dict[str, Any] = {}
    if responses:
        payload["responses"] = responses
    if request_ids:
        payload["streamed"] = {"request_ids": request_ids, "counts": pack_ints(counts),
                               "token_ids": pack_ints(token_ids)}  # fmt: skip
    payload["load"] = load
    return payload


def _logits(value: Any) -> protocol.Logits | None:
    if value is None:
        return None
    a = np.ascontiguousarray(np.asarray(value, dtype="<f4"))
    return protocol.Logits(shape=list(a.shape), data=a.tobytes())
