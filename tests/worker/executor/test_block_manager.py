import random

import pytest

from protocol.block_hash import prompt_hashes
from worker.executor.block_manager import BlockManager, BlockTable, OutOfBlocksError


def test_allocate_and_free_returns_every_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    t = BlockTable()
    assert bm.allocate_prompt(t, list(range(10)), 10) == 0
    assert len(t.block_ids) == 3 and bm.num_free == 5
    bm.ensure_capacity(t, 13)
    assert len(t.block_ids) == 4
    bm.check_invariants([t])
    bm.free(t)
    assert bm.num_free == 8 and t.block_ids == []
    bm.check_invariants([])


def test_out_of_blocks_is_reported_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    t = BlockTable()
    with pytest.raises(OutOfBlocksError):
        bm.allocate_prompt(t, list(range(9)), 9)
    assert bm.num_free == 2 and t.block_ids == []


def test_prefix_reuse_shares_full_blocks_and_recomputes_the_last_token() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 112))  # exactly 3 full blocks
    a = BlockTable()
    bm.allocate_prompt(a, prompt, len(prompt))
    bm.register_full_blocks(a, prompt, len(prompt))
    b = BlockTable()
    cached = bm.allocate_prompt(b, prompt, len(prompt))
    # All three blocks are cached, but the last token's logits are needed: the
    # third block is recomputed into a block of b's own.
    assert cached == 8
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert bm.blocks[a.block_ids[0]].ref_count == 2
    assert bm.reused_blocks == 2
    bm.check_invariants([a, b])

    other = BlockTable()
    assert bm.allocate_prompt(other, [1, 2, 3, 4, 5, 6, 7, 8, 9], 9) == 0  # different prefix: no hit
    bm.check_invariants([a, b, other])


def test_blocks_hashed_under_one_salt_are_never_found_under_another() -> None:
    """The salt is the LoRA adapter or prompt-tuning table: its KV differs for the same tokens."""
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    t = BlockTable()
    bm.allocate_prompt(t, tokens, 9, salt=11)
    bm.register_full_blocks(t, tokens, 9, salt=11)
    assert bm.cached_prefix(tokens, salt=11) == t.block_ids[:2]
    assert bm.cached_prefix(tokens) == [] and bm.cached_prefix(tokens, salt=12) == []
    u = BlockTable()
    assert bm.allocate_prompt(u, tokens, 9, salt=12) == 0
    bm.check_invariants([t, u])


def test_freed_blocks_stay_cached_until_needed_and_evict_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = [1, 2, 3], [7, 8, 9]
    for prompt in (old, new):
        t = BlockTable()
        bm.allocate_prompt(t, prompt, 3)
        bm.register_full_blocks(t, prompt, 3)
        bm.free(t)
    assert bm.num_free == 4
    # Both prefixes still hit after being freed.
    assert len(bm.cached_prefix(old)) == 1 and len(bm.cached_prefix(new)) == 1
    # Taking 3 blocks consumes the two unhashed ones first, then the least
    # recently freed cached block (old's), keeping new's.
    t = BlockTable()
    bm.allocate_prompt(t, [50, 51, 52, 53, 54, 55], 6)
    assert bm.cached_prefix(old) == [] and len(bm.cached_prefix(new)) == 1
    bm.check_invariants([t])


def test_fork_shares_blocks_with_reference_counts() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    t = BlockTable()
    bm.allocate_prompt(t, [1, 2, 3], 3)
    f = bm.fork(t)
    assert f.block_ids == t.block_ids and all(bm.blocks[b].ref_count == 2 for b in t.block_ids)
    bm.free(t)
    bm.check_invariants([f])
    bm.free(f)
    assert bm.num_free == 4


def test_randomized_allocations_never_leak() -> None:
    rng = random.Random(0)
    bm = BlockManager(num_blocks=64, block_size=4)
    live: list[tuple[BlockTable, list[int]]] = []
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    for _ in range(2000):
        if live and (rng.random() < 0.45 or bm.num_free < 8):
            t, _ = live.pop(rng.randrange(len(live)))
            bm.free(t)
        else:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 13)] + [rng.randrange(50) for _ in range(rng.randrange(8))]
            if not prompt:
                continue
            t = BlockTable()
            try:
                bm.allocate_prompt(t, prompt, len(prompt))
                bm.ensure_capacity(t, len(prompt) + rng.randrange(6))
            except OutOfBlocksError:
                bm.free(t)
                continue
            bm.register_full_blocks(t, prompt, len(prompt))
            live.append((t, prompt))
        bm.check_invariants([t for t, _ in live])
    for t, _ in live:
        bm.free(t)
    assert bm.num_free == 64
    bm.check_invariants([])


def test_fork_shares_blocks_and_a_write_into_a_shared_block_copies_it() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    leader = BlockTable()
    bm.allocate_prompt(leader, list(range(6)), 6)  # one full block, one half full
    child = bm.fork(leader)
    assert child.block_ids == leader.block_ids and bm.num_free == 6
    bm.check_invariants([leader, child])
    # the child writes position 6, in the shared half-full block: it gets a copy
    shared = child.block_ids[1]
    assert bm.make_writable(child, 6) == (shared, child.block_ids[1]) and child.block_ids[1] != shared
    assert child.block_ids[0] == leader.block_ids[0] and bm.num_free == 5
    # the leader is now the block's only owner: it writes in place
    assert bm.make_writable(leader, 6) is None
    bm.check_invariants([leader, child])
    bm.free(leader)
    bm.free(child)
    assert bm.num_free == 8
    bm.check_invariants([])


def test_copy_on_write_with_no_free_block_is_out_of_blocks() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    leader = BlockTable()
    bm.allocate_prompt(leader, list(range(3)), 3)
    child = bm.fork(leader)
    bm.ensure_capacity(BlockTable(), 4)  # take the last free block
    with pytest.raises(OutOfBlocksError):
        bm.make_writable(child, 3)
    assert child.block_ids == leader.block_ids


def _replay(events: list[tuple[bool, int]], held: set[int] | None = None) -> set[int]:
    """What a subscriber holds after applying `events` in order; a removal of a hash
    it does not hold means the log was out of order."""
    held = set() if held is None else held
    for stored, h in events:
        if stored:
            assert h not in held, f"hash {h} stored twice without a removal between"
            held.add(h)
        else:
            assert h in held, f"hash {h} removed before it was stored"
            held.remove(h)
    return held


def test_event_log_records_stored_then_evicted_hashes_in_order() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.record_events()
    old, new = [1, 2, 3], [7, 8, 9]
    stored = []
    for prompt in (old, new):
        t = BlockTable()
        bm.allocate_prompt(t, prompt, 3)
        bm.register_full_blocks(t, prompt, 3)
        stored.append(prompt_hashes(prompt, 2))
        bm.free(t)
    assert bm.take_events() == [(True, stored[0][0]), (True, stored[1][0])]
    assert bm.take_events() == []  # drained
    # Three new blocks: the two unhashed ones, then old's, the least recently freed.
    t = BlockTable()
    bm.allocate_prompt(t, [50, 51, 52, 53, 54, 55], 6)
    bm.register_full_blocks(t, [50, 51, 52, 53, 54, 55], 6)
    events = bm.take_events()
    assert events[0] == (False, stored[0][0])
    assert events[1:] == [(True, h) for h in prompt_hashes([50, 51, 52, 53, 54, 55, 0], 2)]
    bm.check_invariants([t])


def test_the_event_log_is_off_until_asked_for() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    t = BlockTable()
    bm.allocate_prompt(t, [1, 2, 3], 3)
    bm.register_full_blocks(t, [1, 2, 3], 3)
    assert bm.take_events() == []


def test_replaying_the_event_log_gives_the_cache_index_under_random_traffic() -> None:
    rng = random.Random(1)
    bm = BlockManager(num_blocks=48, block_size=4)
    bm.record_events()
    held: set[int] = set()
    live: list[BlockTable] = []
    prefixes = [[rng.randrange(50) for _ in range(16)] for _ in range(5)]
    for _ in range(1500):
        if live and (rng.random() < 0.45 or bm.num_free < 8):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 17)] + [rng.randrange(50) for _ in range(rng.randrange(8))]
            t = BlockTable()
            try:
                bm.allocate_prompt(t, prompt, len(prompt))
            except OutOfBlocksError:
                continue
            bm.register_full_blocks(t, prompt, len(prompt))
            live.append(t)
        bm.check_invariants(live)
        if rng.random() < 0.3:  # drained now and then, as once per engine step
            _replay(bm.take_events(), held)
            assert held == bm.cached_hashes()
    _replay(bm.take_events(), held)
    assert held == bm.cached_hashes() and held


def test_a_gateway_hashes_a_prompt_as_the_cache_does() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(30, 47))  # 4 full blocks + 1 token
    t = BlockTable()
    bm.allocate_prompt(t, prompt, len(prompt))
    bm.register_full_blocks(t, prompt, len(prompt))
    assert bm.cached_hashes() == set(prompt_hashes(prompt, 4))
    assert prompt_hashes(prompt, 4, salt=3) != prompt_hashes(prompt, 4)
