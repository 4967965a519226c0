"""Several submits in one message (protocol/submit_batch.py): what encode_submits makes of them."""

from __future__ import annotations

import msgpack
import pytest

import protocol as p
from protocol.submit_batch import MAX_SUBMITS


def _submits(n: int, tokens: int = 3) -> list[bytes]:
    return [p.encode(p.Submit(request_id=f"r{i}", input_token_ids=list(range(1, tokens + 1)), max_tokens=4))
            for i in range(n)]  # fmt: skip


def _request_ids(message: bytes) -> list[str]:
    msg = p.decode(message)
    if isinstance(msg, p.Submit):
        return [msg.request_id]
    assert isinstance(msg, p.SubmitBatch)
    ids = []
    for item in msg.submits:
        submit = p.decode(item)
        assert isinstance(submit, p.Submit)
        ids.append(submit.request_id)
    return ids


def test_a_lone_submit_goes_as_itself():
    (only,) = _submits(1)
    assert list(p.encode_submits([only])) == [only]


def test_several_go_as_one_batch_of_the_same_bytes_in_order():
    encoded = _submits(5)
    (message,) = p.encode_submits(encoded)
    assert msgpack.unpackb(message) == [p.VERSION, "submits", {"submits": encoded}]
    assert _request_ids(message) == [f"r{i}" for i in range(5)]


def test_a_batch_holds_at_most_max_submits():
    messages = list(p.encode_submits(_submits(MAX_SUBMITS + 1)))
    assert [len(_request_ids(m)) for m in messages] == [MAX_SUBMITS, 1]
    assert [r for m in messages for r in _request_ids(m)] == [f"r{i}" for i in range(MAX_SUBMITS + 1)]


def test_batches_stay_within_the_message_size_limit():
    encoded = _submits(6, tokens=200)  # ~850 bytes each
    limits = p.Limits(max_message_bytes=2000)
    messages = list(p.encode_submits(encoded, limits))
    assert all(len(m) <= limits.max_message_bytes for m in messages)
    assert [len(_request_ids(m)) for m in messages] == [2, 2, 2]
    assert [r for m in messages for r in _request_ids(m)] == [f"r{i}" for i in range(6)]


def test_an_empty_or_oversize_batch_is_refused():
    with pytest.raises(p.ProtocolError, match="submits"):
        p.decode(msgpack.packb([p.VERSION, "submits", {"submits": []}]))
    with pytest.raises(p.ProtocolError, match="submits"):
        p.decode(msgpack.packb([p.VERSION, "submits", {"submits": _submits(1) * (MAX_SUBMITS + 1)}]))


def test_a_batch_item_is_bytes_decoded_on_its_own():
    bad = msgpack.packb([p.VERSION, "submit", {"request_id": "r-bad", "max_tokens": 0, "input_token_ids": [1]}])
    batch = p.decode(msgpack.packb([p.VERSION, "submits", {"submits": [_submits(1)[0], bad]}]))
    assert isinstance(batch, p.SubmitBatch)
    assert isinstance(p.decode(batch.submits[0]), p.Submit)
    with pytest.raises(p.ProtocolError, match="max_tokens") as refused:
        p.decode(batch.submits[1])
    assert refused.value.request_id == "r-bad"
    with pytest.raises(p.ProtocolError, match="submits"):
        p.decode(msgpack.packb([p.VERSION, "submits", {"submits": ["not bytes"]}]))
