"""A worker publishes its KV cache index: numbered events to every gateway, a snapshot
after Ready and on request."""

from __future__ import annotations

import pytest

import protocol
from protocol.block_hash import prompt_hashes
from tests.procs import Stack
from tests.worker.service.test_worker_service import FakeGateway
from worker.service.kv_publisher import KvPublisher


def test_folding_keeps_the_net_change_and_numbers_each_message() -> None:
    kv = KvPublisher("w", 16)
    first = kv.fold([[("device", 1), ("device", 2)], [(None, 1), ("device", 3)]])
    assert first is not None and first.seq == 1
    assert sorted(first.stored) == [2, 3] and first.removed == []  # 1 came and went
    second = kv.fold([[(None, 2), ("device", 2), (None, 3)]])
    assert second is not None and second.seq == 2 and second.stored == [] and second.removed == [3]
    assert kv.fold([[("device", 4), (None, 4)]]) is None  # nothing changed: no message, no number
    snap = kv.snapshot()
    assert (snap.seq, sorted(snap.hashes), snap.incarnation) == (2, [2], first.incarnation)
    assert KvPublisher("w", 16).incarnation != kv.incarnation


def test_a_block_moving_to_the_host_tier_is_published_under_its_tier() -> None:
    kv = KvPublisher("w", 16)
    kv.fold([[("device", 1), ("device", 2)]])
    moved = kv.fold([[("host", 1), ("host", 2), ("device", 2)]])  # 2 went to the host and came back
    assert moved is not None and moved.stored_host == [1] and moved.stored == [] and moved.removed == []
    dropped = kv.fold([[(None, 1)]])
    assert dropped is not None and dropped.removed == [1]
    kv.fold([[("host", 2)]])
    snap = kv.snapshot()
    assert snap.hashes == [] and snap.host_hashes == [2]


@pytest.fixture(scope="module")
def worker(service_model, redis_server, tmp_path_factory):
    s = Stack(service_model, redis_server.url, tmp_path_factory.mktemp("kv_publisher"))
    try:
        w = s.worker()
        w.wait_log("redis: connected")
        yield s, w
    finally:
        s.close()


def _of(gw: FakeGateway, kind: type[protocol.Message]) -> list:
    return [m for m in gw.messages if isinstance(m, kind)]


def test_events_follow_the_cache_and_a_snapshot_matches_them(worker) -> None:
    _, w = worker
    gw = FakeGateway.greeted(w.endpoint)
    try:
        gw.recv_until(lambda: bool(_of(gw, protocol.KvSnapshot)))
        (start,) = _of(gw, protocol.KvSnapshot)
        held = set(start.hashes)
        prompt = [(7 * i) % 300 + 3 for i in range(3 * start.block_size + 5)]
        gw.send(protocol.Submit(request_id="kv-1", input_token_ids=prompt, max_tokens=2))
        chain = prompt_hashes(prompt, start.block_size)
        gw.recv_until(lambda: gw.final("kv-1") and held | {h for e in _of(gw, protocol.KvEvents)
                                                            for h in e.stored} >= set(chain))  # fmt: skip
        events = _of(gw, protocol.KvEvents)
        assert [e.seq for e in events] == list(range(start.seq + 1, start.seq + 1 + len(events)))
        assert {e.incarnation for e in events} == {start.incarnation}
        for e in events:
            held = (held - set(e.removed)) | set(e.stored)
        assert set(chain) <= held

        gw.send(protocol.KvSnapshotRequest(sender_id="fake-gw"))
        gw.recv_until(lambda: len(_of(gw, protocol.KvSnapshot)) == 2)
        snap = _of(gw, protocol.KvSnapshot)[1]
        assert snap.incarnation == start.incarnation and snap.seq == _of(gw, protocol.KvEvents)[-1].seq
        assert set(snap.hashes) == held
    finally:
        gw.close()


def test_a_gateway_heard_from_without_hello_gets_a_snapshot(worker) -> None:
    """As after the worker restarted under a gateway that stayed connected."""
    _, w = worker
    gw = FakeGateway(w.endpoint, name="known-before")
    try:
        gw.send(protocol.Heartbeat(sender_id="known-before"))
        gw.recv_until(lambda: bool(_of(gw, protocol.KvSnapshot)))
        assert not _of(gw, protocol.Ready)
    finally:
        gw.close()
