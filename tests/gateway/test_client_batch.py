"""A client's share of a worker batch on the wire: columns with their text, whole
responses after them, split where the client's limits need it."""

from __future__ import annotations

import protocol
from gateway.client_batch import ClientBatch


def _batch() -> ClientBatch:
    batch = ClientBatch()
    for i, tokens in enumerate([[1], [2, 3], [4], [5, 6, 7], [8]]):
        batch.add_step(f"r{i % 2}", tokens, f"t{i}")
    for i in range(3):
        reasons = [protocol.FinishReason.LENGTH]
        result = protocol.Result(is_final=True, output_token_ids=[[9 + i]], finish_reasons=reasons, text=[f"end{i}"])
        batch.add_response(protocol.Response(request_id=f"e{i}", result=result))
    return batch


def _read(messages: list[bytes], limits: protocol.Limits) -> list[tuple[str, list[int], str, bool]]:
    out = []
    for data in messages:
        msg = protocol.decode(data, limits)
        assert isinstance(msg, protocol.ResultBatch) and msg.load is None
        for r in msg.all_responses():
            assert r.result is not None and r.result.text is not None
            out.append((r.request_id, r.result.output_token_ids[0], r.result.text[0], r.is_final))
    return out


EXPECTED = [
    ("r0", [1], "t0", False), ("r1", [2, 3], "t1", False), ("r0", [4], "t2", False), ("r1", [5, 6, 7], "t3", False),
    ("r0", [8], "t4", False), ("e0", [9], "end0", True), ("e1", [10], "end1", True), ("e2", [11], "end2", True),
]  # fmt: skip


def test_one_message_carries_columns_then_whole_responses():
    (message,) = list(_batch().messages(protocol.DEFAULT_LIMITS))
    assert _read([message], protocol.DEFAULT_LIMITS) == EXPECTED


def test_more_entries_than_the_client_takes_in_one_array_go_in_several_messages():
    limits = protocol.Limits(max_array_len=3)
    messages = list(_batch().messages(limits))
    assert len(messages) == 3  # columns 3 + 2, responses 3
    assert _read(messages, limits) == EXPECTED
