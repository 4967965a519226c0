"""Wire models (protocol) to the executor's dataclasses and back."""

from __future__ import annotations

from typing import Any

import numpy as np

import protocol
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
    )


def to_wire_response(request_id: str, response: ex.Response) -> protocol.Response:
    """Built without validation (model_construct): the executor's output is ours and
    this runs for every token; the gateway validates what it receives."""
    if response.error_msg is not None:
        return protocol.Response(request_id=request_id, error_msg=response.error_msg, client_id=response.client_id)
    r = response.result
    assert r is not None
    result = protocol.Result.model_construct(
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
        text=None,
    )
    return protocol.Response.model_construct(
        request_id=request_id, result=result, error_msg=None, client_id=response.client_id
    )


def _logits(value: Any) -> protocol.Logits | None:
    if value is None:
        return None
    a = np.ascontiguousarray(np.asarray(value, dtype="<f4"))
    return protocol.Logits(shape=list(a.shape), data=a.tobytes())
