"""Each decoding limit: a message at the bound passes, one just past it fails."""

from __future__ import annotations

import tracemalloc
from typing import Any

import msgpack
import pytest

import protocol as p

NOT_FINISHED = p.FinishReason.NOT_FINISHED

SMALL = p.Limits(max_message_bytes=64, max_str_len=8, max_bin_len=8, max_array_len=4, max_map_len=3, max_depth=3)


def nested(depth: int) -> Any:
    value: Any = 0
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


@pytest.mark.parametrize(
    ("at_limit", "past_limit", "rule"),
    [
        ("a" * 8, "a" * 9, "max_str_len"),
        (b"a" * 8, b"a" * 9, "max_bin_len"),
        ([0] * 4, [0] * 5, "max_array_len"),
        ({"a": 0, "b": 0, "c": 0}, {"a": 0, "b": 0, "c": 0, "d": 0}, "max_map_len"),
        (nested(3), nested(4), "deeper than 3 levels"),
    ],
)
def test_limit_at_and_past(at_limit: Any, past_limit: Any, rule: str):
    assert p.unpack(msgpack.packb(at_limit, use_bin_type=True), SMALL) == at_limit
    with pytest.raises(p.ProtocolError, match=rule):
        p.unpack(msgpack.packb(past_limit, use_bin_type=True), SMALL)


def test_message_size_at_and_past():
    data = msgpack.packb([1, 2, 3])
    assert p.unpack(data, p.Limits(max_message_bytes=len(data))) == [1, 2, 3]
    with pytest.raises(p.ProtocolError, match=f"message is {len(data)} bytes; the limit is {len(data) - 1}"):
        p.unpack(data, p.Limits(max_message_bytes=len(data) - 1))


def test_encode_refuses_a_message_over_the_size_limit():
    msg = p.Submit(request_id="r", prompt="x" * 100, max_tokens=1)
    with pytest.raises(p.ProtocolError, match=r"submit message is \d+ bytes; the limit is 64"):
        p.encode(msg, SMALL)


def test_default_prompt_length_limit():
    limit = p.DEFAULT_LIMITS.max_str_len
    ok = p.Submit(request_id="r", prompt="x" * limit, max_tokens=1)
    assert p.decode(p.encode(ok)) == ok
    too_long = p.Submit(request_id="r", prompt="x" * (limit + 1), max_tokens=1)
    with pytest.raises(p.ProtocolError, match="max_str_len"):
        p.decode(p.encode(too_long))


def test_default_batch_size_limit():
    def batch(n: int) -> list[p.Response]:
        result = p.Result(is_final=False, output_token_ids=[[1]], finish_reasons=[NOT_FINISHED])
        return [p.Response(request_id=str(i), result=result) for i in range(n)]

    limit = p.DEFAULT_LIMITS.max_array_len
    ok = p.ResultBatch(responses=batch(limit))
    assert len(p.decode(p.encode(ok)).responses) == limit  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="at most 4096 items"):
        p.ResultBatch(responses=batch(limit + 1))
    oversize = msgpack.packb([1, "results", {"responses": [{"request_id": "x"}] * (limit + 1)}])
    with pytest.raises(p.ProtocolError, match="max_array_len"):
        p.decode(oversize)


@pytest.mark.parametrize("depth", [100, 900, 5000])
def test_deep_nesting_is_refused_without_recursion(depth: int):
    data = b"\x91" * depth + b"\x00"  # [[[...0...]]]
    with pytest.raises(p.ProtocolError):
        p.decode(data)


def test_declared_lengths_cannot_claim_unbounded_memory():
    # Every level declares the largest array the limits allow, then the data ends:
    # msgpack preallocates each level, so the limits alone bound the memory.
    header = b"\xdd" + p.DEFAULT_LIMITS.max_array_len.to_bytes(4, "big")
    data = header * 2000
    huge = b"\xdd\xff\xff\xff\xff" + b"\xdf\xff\xff\xff\xff"
    tracemalloc.start()
    try:
        for attempt in (data, huge, b"\xc6\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff"):
            with pytest.raises(p.ProtocolError):
                p.decode(attempt)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"decoding a short message peaked at {peak} bytes"


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_depth must be >= 1"):
        p.Limits(max_depth=0)


def test_packed_values_at_and_past():
    msg = p.Submit(request_id="r", input_token_ids=[1, 2, 3], stop_words=[[4], [5, 6]], max_tokens=1)
    wire = p.encode(msg)
    assert p.decode(wire, p.Limits(max_packed_values=6)) == msg
    with pytest.raises(p.ProtocolError, match=r"packs more than max_packed_values \(5\) numbers"):
        p.decode(wire, p.Limits(max_packed_values=5))


def test_packed_floats_count_too():
    msg = p.Submit(request_id="r", prompt="x", embedding_bias=[0.0] * 10, max_tokens=1)
    assert p.decode(p.encode(msg), p.Limits(max_packed_values=10)) == msg
    with pytest.raises(p.ProtocolError, match="max_packed_values"):
        p.decode(p.encode(msg), p.Limits(max_packed_values=9))


def test_too_many_packed_values_are_refused_before_expanding():
    count = p.DEFAULT_LIMITS.max_packed_values + 1
    payload = {"request_id": "r", "input_token_ids": b"\x07\x01\x00\x00" * count, "max_tokens": 1}
    data = msgpack.packb([1, "submit", payload], use_bin_type=True)
    tracemalloc.start()
    try:
        with pytest.raises(p.ProtocolError, match="max_packed_values"):
            p.decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(data), f"refusing {len(data)} bytes peaked at {peak} bytes"


def test_top_log_probs_of_a_long_output_fit_the_array_limit():
    tokens = p.DEFAULT_LIMITS.max_array_len * 2
    result = p.Result(
        is_final=True,
        output_token_ids=[list(range(tokens))],
        finish_reasons=[p.FinishReason.LENGTH],
        top_token_ids=[[[t, t + 1, t + 2] for t in range(tokens)]],
        top_log_probs=[[[-0.5, -1.5, -2.5]] * tokens],
    )
    batch = p.ResultBatch(responses=[p.Response(request_id="r", result=result)])
    assert p.decode(p.encode(batch)) == batch
