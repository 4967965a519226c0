"""A gateway's copy of one worker's KV cache index: events in order, gaps and restarts
repaired by snapshot."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

import protocol
from gateway import prefix_index
from gateway.prefix_index import PrefixIndex


def events(seq: int, stored: Sequence[int] = (), removed: Sequence[int] = (), incarnation: str = "a"
           ) -> protocol.KvEvents:  # fmt: skip
    return protocol.KvEvents(sender_id="w", incarnation=incarnation, seq=seq, stored=list(stored),
                             removed=list(removed))  # fmt: skip


def snapshot(seq: int, hashes: list[int], incarnation: str = "a") -> protocol.KvSnapshot:
    return protocol.KvSnapshot(sender_id="w", incarnation=incarnation, seq=seq, block_size=16, hashes=hashes)


def test_events_in_order_after_a_snapshot_are_applied() -> None:
    index = PrefixIndex()
    index.apply_snapshot(snapshot(3, [1, 2]))
    assert not index.apply_events(events(3, [99]))  # already in the snapshot: ignored
    assert not index.apply_events(events(4, [3], [1]))
    assert not index.apply_events(events(5, [4]))
    assert index.hashes == {2, 3, 4} and index.seq == 5 and index.block_size == 16


def test_a_gap_asks_for_a_snapshot_once_and_the_snapshot_repairs_it() -> None:
    index = PrefixIndex()
    index.apply_snapshot(snapshot(0, []))
    assert not index.apply_events(events(1, [1, 2]))
    assert index.apply_events(events(3, [5]))  # event 2 was lost
    assert not index.apply_events(events(4, [6]))  # asked already: events wait for the answer
    assert index.hashes == {1, 2} and not index.synced  # a hint meanwhile, never half-applied
    index.apply_snapshot(snapshot(4, [2, 5, 6]))
    assert index.hashes == {2, 5, 6} and index.synced
    assert not index.apply_events(events(5, [7]))
    assert index.hashes == {2, 5, 6, 7}


def test_an_unanswered_ask_is_repeated_after_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(prefix_index.time, "monotonic", lambda: now[0])
    index = PrefixIndex()
    assert index.apply_events(events(7, [1]))  # joined mid-stream with no snapshot
    assert not index.apply_events(events(8, [2]))
    now[0] += prefix_index.ASK_AGAIN_S + 0.1
    assert index.apply_events(events(9, [3]))


def test_an_older_snapshot_never_undoes_newer_events() -> None:
    index = PrefixIndex()
    index.apply_snapshot(snapshot(2, [1]))
    index.apply_events(events(3, [2]))
    index.apply_snapshot(snapshot(2, [1]))  # the answer to a second ask, overtaken
    assert index.hashes == {1, 2} and index.seq == 3


def test_a_new_incarnation_empties_the_entry() -> None:
    index = PrefixIndex()
    index.apply_snapshot(snapshot(9, [1, 2, 3]))
    # The worker restarted: its first event under its new name starts from an empty cache.
    assert not index.apply_events(events(1, [7], incarnation="b"))
    assert index.hashes == {7} and index.incarnation == "b"
    index2 = PrefixIndex()
    index2.apply_snapshot(snapshot(9, [1, 2, 3]))
    assert index2.apply_events(events(4, [8], incarnation="b"))  # its first events were missed
    assert index2.hashes == set()


def test_matched_counts_the_leading_blocks_held() -> None:
    index = PrefixIndex()
    index.apply_snapshot(snapshot(1, [10, 11, 13]))
    assert index.matched([10, 11, 12, 13]) == (2, 0)
    assert index.matched([12, 10]) == (0, 0) and index.matched([]) == (0, 0)


def test_a_block_moving_between_tiers_is_held_in_the_one_its_event_names() -> None:
    index = PrefixIndex()
    index.apply_snapshot(protocol.KvSnapshot(sender_id="w", incarnation="a", seq=1, block_size=16, hashes=[10, 11],
                                             host_hashes=[12]))  # fmt: skip
    assert index.matched([10, 11, 12, 13]) == (3, 1)  # both tiers count, the host's reported apart
    index.apply_events(protocol.KvEvents(sender_id="w", incarnation="a", seq=2, stored=[12], stored_host=[11]))
    assert index.hashes == {10, 12} and index.host_hashes == {11}
    index.apply_events(protocol.KvEvents(sender_id="w", incarnation="a", seq=3, removed=[11]))
    assert index.host_hashes == set() and index.matched([10, 11, 12]) == (1, 0)
