"""A worker's result batch is byte for byte what the protocol models would encode,
so gateways validate it like any other message; the core's plain streamed steps
travel in columns and stand for the same responses."""

from __future__ import annotations

import numpy as np
import pytest

import protocol
from worker.executor import types as ex
from worker.service.convert import WireBatch, to_wire_response

F = ex.FinishReason
RESPONSES = {
    "streamed token": ex.Response(1, ex.Result(False, [[42]], [F.NOT_FINISHED])),
    "several tokens": ex.Response(1, ex.Result(False, [[1, 2, 3]], [F.NOT_FINISHED])),
    "final": ex.Response(2, ex.Result(True, [[7]], [F.LENGTH], is_sequence_final=True)),
    "no new tokens": ex.Response(2, ex.Result(True, [[]], [F.CANCELLED], is_sequence_final=True)),
    "returned sequence": ex.Response(3, ex.Result(False, [[5]], [F.END_ID], sequence_index=2, is_sequence_final=True)),
    "client id": ex.Response(4, ex.Result(False, [[9]], [F.NOT_FINISHED]), client_id=2**63),
    "beams": ex.Response(5, ex.Result(True, [[1, 2], [1, 3]], [F.END_ID, F.LENGTH], is_sequence_final=True)),
    "log probs": ex.Response(6, ex.Result(False, [[4]], [F.NOT_FINISHED], cum_log_probs=[-0.5], log_probs=[[-0.5]])),
    "top tokens": ex.Response(
        6, ex.Result(False, [[4]], [F.NOT_FINISHED], top_token_ids=[[[4, 8]]], top_log_probs=[[[-0.125, -2.5]]])
    ),
    "logits": ex.Response(
        7, ex.Result(True, [[4]], [F.LENGTH], is_sequence_final=True, generation_logits=np.zeros((1, 1, 3), np.float32))
    ),
    "error": ex.Response(8, error_msg="prompt too long", client_id=3),
}


def test_a_batch_encodes_to_the_same_bytes_and_validates() -> None:
    names = list(RESPONSES)
    load = protocol.WorkerLoad(num_active_requests=3, free_num_blocks=10, max_num_blocks=64)
    batch = WireBatch()
    for n in names:
        batch.add(n, RESPONSES[n])
    [payload] = batch.payloads(load.model_dump(exclude_defaults=True), 4096)
    fast = protocol.encode_payload(protocol.ResultBatch.kind, payload)
    models = protocol.ResultBatch(responses=[to_wire_response(n, RESPONSES[n]) for n in names], load=load)
    assert fast == protocol.encode(models)
    assert protocol.decode(fast) == models


COLUMNS = {"streamed token", "several tokens"}  # the plain streamed steps among RESPONSES


@pytest.mark.parametrize("max_array_len", [4096, 2])
def test_a_wire_batch_stands_for_the_same_responses(max_array_len: int) -> None:
    # Interleaved as a delivery may be: streamed steps of requests between others' results.
    names = [n for n in RESPONSES if n not in COLUMNS]
    order = [("s1", "streamed token"), *[(n, n) for n in names[:3]], ("s2", "several tokens"), ("s1", "streamed token"),
             *[(n, n) for n in names[3:]]]  # fmt: skip
    batch = WireBatch()
    for request_id, name in order:
        if name in COLUMNS:
            response = RESPONSES[name]
            assert response.result is not None
            batch.add_streamed(request_id, response.result.output_token_ids[0])
        else:
            batch.add(request_id, RESPONSES[name])
    load = protocol.WorkerLoad(num_active_requests=3, max_num_blocks=64)
    payloads = list(batch.payloads(load.model_dump(exclude_defaults=True), max_array_len))
    assert len(payloads) == (1 if max_array_len > 8 else 2 + 5)  # 3 streamed steps, 9 whole responses
    decoded = []
    for payload in payloads:
        wire = protocol.encode_payload(protocol.ResultBatch.kind, payload)
        msg = protocol.decode(wire)
        assert isinstance(msg, protocol.ResultBatch)
        assert wire == protocol.encode(msg)  # what the models encode, byte for byte
        assert msg.load == load
        decoded += msg.all_responses()
    want = [to_wire_response(request_id, RESPONSES[name]) for request_id, name in order]
    # Each request's responses in their order; the columns (sent first) move ahead of other requests' results.
    for request_id in {rid for rid, _ in order}:
        assert [r for r in decoded if r.request_id == request_id] == [r for r in want if r.request_id == request_id]
    assert len(decoded) == len(want)


def _with_logits(request_id: int, rows: int) -> ex.Response:
    logits = np.ones((rows, 256), np.float32)  # 1 KiB a row
    return ex.Response(request_id, ex.Result(True, [[4]], [F.LENGTH], is_sequence_final=True, context_logits=logits))


def test_results_over_the_message_limit_split_or_become_errors() -> None:
    """A batch over the message limit is split, or its oversize entries become errors:
    dropped whole, it would cost every stream in it its tokens and hang the request
    that made it large."""
    limits = protocol.Limits(max_message_bytes=100 << 10)
    batch = WireBatch()
    batch.add_streamed("innocent", [1, 2])
    batch.add("fits", _with_logits(1, 60))  # 60 KiB: fits alone, not with the other
    batch.add("fits too", _with_logits(2, 60))
    batch.add("too large", _with_logits(3, 120))  # 120 KiB: never fits
    messages, unsent = batch.messages({}, limits)
    assert list(unsent) == ["too large"]
    assert "could not be sent" in (unsent["too large"].error_msg or "")
    responses = [r for m in messages for r in protocol.decode(m, limits).all_responses()]  # type: ignore[attr-defined]
    by_id = {r.request_id: r for r in responses}
    assert by_id["innocent"].result.output_token_ids == [[1, 2]]
    assert by_id["fits"].result.context_logits.shape == [60, 256]
    assert by_id["fits too"].result.context_logits.shape == [60, 256]
    assert by_id["too large"].error_msg == unsent["too large"].error_msg
    assert len(responses) == 4


def test_a_batch_within_the_limit_is_one_message() -> None:
    batch = WireBatch()
    batch.add_streamed("a", [1])
    batch.add("b", _with_logits(1, 10))
    messages, unsent = batch.messages({}, protocol.DEFAULT_LIMITS)
    assert len(messages) == 1 and not unsent
