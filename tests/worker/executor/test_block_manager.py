import random

import pytest

from protocol.block_hash import prompt_hashes
from worker.executor.block_manager import BlockEvent, BlockManager, BlockTable, OutOfBlocksError


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
    assert [hit.where for hit in bm.cached_prefix(tokens, salt=11)] == t.block_ids[:2]
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


def _replay(events: list[BlockEvent], held: set[int] | None = None) -> set[int]:
    """What a subscriber holds after applying `events` in order; a removal of a hash
    it does not hold means the log was out of order."""
    held = set() if held is None else held
    for tier, h in events:
        if tier == "device":
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
    assert bm.take_events() == [("device", stored[0][0]), ("device", stored[1][0])]
    assert bm.take_events() == []  # drained
    # Three new blocks: the two unhashed ones, then old's, the least recently freed.
    t = BlockTable()
    bm.allocate_prompt(t, [50, 51, 52, 53, 54, 55], 6)
    bm.register_full_blocks(t, [50, 51, 52, 53, 54, 55], 6)
    events = bm.take_events()
    assert events[0] == (None, stored[0][0])
    assert events[1:] == [("device", h) for h in prompt_hashes([50, 51, 52, 53, 54, 55, 0], 2)]
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


# -- the host tier ------------------------------------------------------------------------


def _cache(bm: BlockManager, prompt: list[int]) -> BlockTable:
    """Run a prompt through the cache: allocated, hashed, freed (its full blocks stay cached)."""
    t = BlockTable()
    bm.allocate_prompt(t, prompt, len(prompt))
    bm.register_full_blocks(t, prompt, len(prompt))
    bm.free(t)
    return t


def test_an_evicted_block_moves_to_the_host_and_a_hit_loads_it_back() -> None:
    bm = BlockManager(num_blocks=2, block_size=2, host_blocks=4)
    bm.record_events()
    old = [1, 2, 3]
    first = _cache(bm, old)
    (h,) = prompt_hashes(old, 2)
    device_block = bm.cached_prefix(old)[0].where
    assert bm.take_events() == [("device", h)]
    t = BlockTable()
    bm.allocate_prompt(t, [50, 51, 52, 53], 4)  # takes both blocks: old's is evicted
    transfers = bm.take_transfers()
    assert transfers is not None and transfers.offload_src.tolist() == [device_block]
    assert transfers.load_src.size == 0
    assert bm.take_events() == [("host", h)]
    assert bm.cached_prefix(old) == [(True, transfers.offload_dst[0])] and bm.host_hashes() == {h}
    bm.check_invariants([t])
    bm.free(t)

    back = BlockTable()
    assert bm.allocate_prompt(back, old, 3) == 2  # the host block counts as cached
    loads = bm.take_transfers()
    assert loads is not None and loads.offload_src.size == 0
    assert loads.load_src.tolist() == transfers.offload_dst.tolist() and loads.load_dst.tolist() == back.block_ids[:1]
    assert back.num_from_host == 1 and bm.reused_host_blocks == 1 and bm.reused_blocks == 1
    assert bm.cached_hashes() == {h} and bm.host_hashes() == set()
    assert bm.take_events() == [("device", h)]
    assert first.block_ids == []
    bm.check_invariants([back])
    bm.free(back)
    bm.check_invariants([])
    assert bm.num_free == 2


def test_a_full_host_tier_evicts_its_least_recently_stored_block() -> None:
    bm = BlockManager(num_blocks=2, block_size=2, host_blocks=2)
    bm.record_events()
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    hashes = [prompt_hashes(p, 2)[0] for p in prompts]
    for p in prompts:  # each prompt takes both blocks: the one before's full block goes to the host
        _cache(bm, p)
    bm.take_transfers()
    # the host holds 2 of the 3 evicted: the first was dropped when the third arrived
    assert bm.cached_hashes() == {hashes[3]} and bm.host_hashes() == {hashes[1], hashes[2]}
    assert bm.cached_prefix(prompts[0]) == []
    assert (None, hashes[0]) in bm.take_events()
    assert bm.offloaded_blocks == 3
    bm.check_invariants([])


def test_a_block_computed_again_on_the_device_leaves_the_host() -> None:
    """A hash lives in one tier: the device copy wins, the host slot is freed."""
    bm = BlockManager(num_blocks=3, block_size=2, host_blocks=4)
    prompt = [1, 2, 3, 4, 5]
    _cache(bm, prompt)
    _cache(bm, [9, 9, 9, 9, 9])  # evicts both of prompt's blocks to the host
    bm.take_transfers()
    assert bm.host_hashes() == set(prompt_hashes(prompt, 2))
    t = BlockTable()
    bm.allocate_prompt(t, prompt[:1], 5)  # no lookup (a prompt wanting its logits): recomputed
    assert bm.host_hashes() >= set(prompt_hashes(prompt, 2))
    bm.register_full_blocks(t, prompt, 5)
    assert bm.cached_hashes() == set(prompt_hashes(prompt, 2))
    assert not bm.host_hashes() & set(prompt_hashes(prompt, 2))
    bm.check_invariants([t])


def _replay_tiers(events: list[BlockEvent], held: dict[int, str]) -> None:
    """Apply events as a gateway does: a hash is held in the tier its last event names."""
    for tier, h in events:
        if tier is None:
            assert h in held, f"hash {h} removed before it was stored"
            del held[h]
        else:
            assert held.get(h) != tier, f"hash {h} stored in {tier} twice"
            held[h] = tier


def test_random_workloads_over_both_tiers_keep_every_block_in_one_state() -> None:
    rng = random.Random(2)
    bm = BlockManager(num_blocks=24, block_size=4, host_blocks=16)
    bm.record_events()
    held: dict[int, str] = {}
    live: list[BlockTable] = []
    prefixes = [[rng.randrange(50) for _ in range(24)] for _ in range(6)]  # together 36 blocks: more than the pool
    for _ in range(1500):
        if live and (rng.random() < 0.45 or bm.num_free < 8):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 25)] + [rng.randrange(50) for _ in range(rng.randrange(6))]
            t = BlockTable()
            try:
                bm.allocate_prompt(t, prompt, len(prompt))
                bm.ensure_capacity(t, len(prompt) + rng.randrange(6))
            except OutOfBlocksError:
                bm.free(t)
                continue
            bm.register_full_blocks(t, prompt, len(prompt))
            live.append(t)
            if rng.random() < 0.2:  # beams: a fork whose write into the shared block copies it
                child = bm.fork(t)
                try:
                    bm.make_writable(child, len(prompt) - 1)
                    live.append(child)
                except OutOfBlocksError:
                    bm.free(child)
        if rng.random() < 0.5:  # handed to the backend once per engine step
            bm.take_transfers()
        bm.check_invariants(live)
        if rng.random() < 0.3:
            _replay_tiers(bm.take_events(), held)
            assert {h for h, tier in held.items() if tier == "device"} == bm.cached_hashes()
            assert {h for h, tier in held.items() if tier == "host"} == bm.host_hashes()
    for t in live:
        bm.free(t)
    bm.take_transfers()
    _replay_tiers(bm.take_events(), held)
    assert bm.reused_host_blocks > 0 and bm.offloaded_blocks > 0
    assert bm.num_free == 24 and bm.host is not None and bm.host.num_cached == len(bm.host_hashes())
    assert set(held) == bm.cached_hashes() | bm.host_hashes()
    bm.check_invariants([])
