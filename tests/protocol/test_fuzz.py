"""Random and mutated bytes: `decode` returns a valid message or raises
ProtocolError, never anything else, with bounded time and memory."""

from __future__ import annotations

import random
import tracemalloc
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import protocol as p
from tests.protocol.strategies import any_message

# Bytes that start msgpack containers and strings with large declared lengths.
INTERESTING = [
    b"\xdd\xff\xff\xff\xff",
    b"\xdf\x00\x01\x00\x00",
    b"\xc6\x7f\xff\xff\xff",
    b"\xdb\x00\x10\x00\x00",
    b"\x9f",
    b"\x8f",
    b"\xc1",
    b"\xd4\x01\x00",
    b"\xc0",
    b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00",
]


def check(data: bytes) -> None:
    try:
        msg = p.decode(data)
    except p.ProtocolError as e:
        message = str(e)
    else:
        assert isinstance(msg, p.Message)
        assert p.decode(p.encode(msg)) == msg
        return
    assert message, "a ProtocolError must say what is wrong"


def mutate(rng: random.Random, data: bytes, others: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        pos = rng.randrange(len(buf) + 1)
        if op == 0 and buf:  # flip bits
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1:  # random byte
            buf.insert(pos, rng.randrange(256))
        elif op == 2 and buf:  # delete a run
            del buf[pos : pos + rng.randint(1, 8)]
        elif op == 3:  # truncate
            del buf[pos:]
        elif op == 4:  # splice in a piece of another message
            other = rng.choice(others)
            start = rng.randrange(len(other))
            buf[pos:pos] = other[start : start + rng.randint(1, 32)]
        else:  # a header with a large declared length
            buf[pos:pos] = rng.choice(INTERESTING)
    return bytes(buf)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_message, any_message, st.randoms(use_true_random=False))
def test_mutated_messages(msg: p.Message, other: p.Message, rng: random.Random):
    wire, spare = p.encode(msg), p.encode(other)
    for _ in range(4):
        check(mutate(rng, wire, [wire, spare]))


def replace_somewhere(rng: random.Random, tree: Any) -> Any:
    """Swap one value somewhere in a decoded message for a random one of any type."""
    if type(tree) is dict and tree and rng.random() < 0.8:
        key = rng.choice(list(tree))
        if rng.random() < 0.15:
            return {k: v for k, v in tree.items() if k != key}
        return {**tree, key: replace_somewhere(rng, tree[key])}
    if type(tree) is list and tree and rng.random() < 0.8:
        i = rng.randrange(len(tree))
        return [*tree[:i], replace_somewhere(rng, tree[i]), *tree[i + 1 :]]
    return rng.choice(VALUES)


VALUES: list[Any] = [
    *(None, True, False, 0, -1, 1, 2**31, 2**64 - 1, -(2**63), 0.5, -1e300, float("inf"), float("nan")),
    *("", "x", "results", b"", b"\x01\x00\x00", b"\xff\xff\xff\xff"),
    *([], [0], [[]], {}, {"x": 1}, {"request_id": "r"}),
]


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_message, st.randoms(use_true_random=False))
def test_messages_with_wrong_values(msg: p.Message, rng: random.Random):
    tree = msgpack.unpackb(p.encode(msg))
    for _ in range(4):
        check(msgpack.packb(replace_somewhere(rng, tree), use_bin_type=True))


@pytest.mark.timeout(120)
def test_memory_stays_bounded():
    rng = random.Random(3)
    seeds = [
        p.encode(p.Submit(request_id="r", input_token_ids=[1, 2, 3], max_tokens=4)),
        p.encode(p.ResultBatch(responses=[p.Response(request_id="r", error_msg="x")], load=p.WorkerLoad())),
    ]
    tracemalloc.start()
    try:
        for _ in range(3000):
            check(mutate(rng, rng.choice(seeds), seeds))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 128 << 20, f"fuzzing peaked at {peak} bytes"


@pytest.mark.timeout(120)
def test_random_bytes():
    rng = random.Random(7)
    for _ in range(4000):
        check(rng.randbytes(rng.randint(0, 64)))
    for _ in range(2000):  # random bytes behind a plausible envelope start
        check(b"\x93\x01" + rng.choice([b"\xa6submit", b"\xa7results", b"\xa6cancel"]) + rng.randbytes(40))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_hypothesis_bytes(data: bytes):
    check(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_message, st.data())
def test_hypothesis_truncations(msg: p.Message, data: st.DataObject):
    wire = p.encode(msg)
    cut = data.draw(st.integers(0, len(wire) - 1))
    with pytest.raises(p.ProtocolError):
        p.decode(wire[:cut])
