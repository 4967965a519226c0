"""Routing by the prompt blocks a worker's KV cache holds, against its load."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

import protocol
from gateway.prefix_router import PrefixRouter, cost
from gateway.workers import WorkerLink
from ops.metrics import GatewayMetrics
from protocol.block_hash import prompt_hashes

BLOCK = 16
PROMPT = list(range(3, 3 + 10 * BLOCK + 1))  # 10 full blocks + the last token
CHAIN = prompt_hashes(PROMPT, BLOCK)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def link(ctx: zmq.Context, worker_id: str, held: list[int], active: int = 0, used_blocks: int = 0) -> WorkerLink:
    info = protocol.WorkerInfo(worker_id=worker_id, address="tcp://127.0.0.1:1", models=["m"], host="h", pid=1,
                               started_at=0.0)  # fmt: skip
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    load = protocol.WorkerLoad(num_active_requests=active, free_num_blocks=1000 - used_blocks, max_num_blocks=1000)
    w = WorkerLink(info, sock, ready=True, models=["m"], load=load)
    w.kv.apply_snapshot(protocol.KvSnapshot(sender_id=worker_id, incarnation="i", seq=0, block_size=BLOCK,
                                            hashes=held))  # fmt: skip
    return w


def submit(lora: str | None = None) -> protocol.Submit:
    config = None if lora is None else protocol.LoraConfig(name=lora)
    return protocol.Submit(request_id="r", input_token_ids=PROMPT, max_tokens=4, lora_config=config)


def test_a_heavier_overlap_weight_keeps_a_prompt_home_under_more_decode_load(ctx: zmq.Context) -> None:
    holder = link(ctx, "holder", CHAIN[:8], active=2, used_blocks=20)
    idle = link(ctx, "idle", [])
    assert PrefixRouter("gw", GatewayMetrics(), overlap_weight=1.0).pick([holder, idle], "m", submit()) is idle
    assert PrefixRouter("gw", GatewayMetrics(), overlap_weight=4.0).pick([holder, idle], "m", submit()) is holder


def test_cost_weighs_prefill_against_decode_blocks() -> None:
    assert cost(prefill_blocks=10, decode_blocks=5.0, overlap_weight=1.0) == 15.0
    assert cost(prefill_blocks=10, decode_blocks=5.0, overlap_weight=2.0) == 25.0


def test_a_prefix_in_the_host_tier_costs_less_than_a_miss_and_more_than_the_device(ctx: zmq.Context) -> None:
    assert cost(prefill_blocks=2, decode_blocks=0.0, overlap_weight=4.0, host_blocks=8) == 4.0 * (2 + 8 * 0.25)
    on_device = link(ctx, "device", CHAIN[:8], active=1, used_blocks=4)
    on_host = link(ctx, "host", [], active=1, used_blocks=4)
    # A later snapshot (seq 1) than link()'s: the worker's blocks have since moved to its host tier.
    on_host.kv.apply_snapshot(protocol.KvSnapshot(sender_id="host", incarnation="i", seq=1, block_size=BLOCK,
                                                  host_hashes=CHAIN[:8]))  # fmt: skip
    assert on_host.kv.matched(CHAIN[:8]) == (8, 8)
    cold = link(ctx, "cold", [], active=1, used_blocks=4)
    router = PrefixRouter("gw", GatewayMetrics())
    assert router.pick([on_device, on_host, cold], "m", submit()) is on_device
    assert router.pick([on_host, cold], "m", submit()) is on_host


def test_the_worker_holding_the_prefix_wins_while_it_has_room(ctx: zmq.Context) -> None:
    router = PrefixRouter("gw", GatewayMetrics(), overlap_weight=1.0)
    holder = link(ctx, "holder", CHAIN[:8], active=3, used_blocks=6)  # busier, but holds 8 of 10 blocks
    idle = link(ctx, "idle", [])
    for _ in range(20):
        assert router.pick([holder, idle], "m", submit()) is holder
        holder.update_load(holder.load)  # a load report: what was sent since is counted in it
    # Without a report, what this gateway sent counts: 3 + 6 + 11 blocks sent > 11 to prefill elsewhere.
    # (At weight 4 the holder takes both: 4 x 3 + 6 + 11 < 4 x 11.)
    assert [router.pick([holder, idle], "m", submit()) for _ in range(2)] == [holder, idle]


def test_a_worker_far_busier_than_the_rest_spills_over(ctx: zmq.Context) -> None:
    router = PrefixRouter("gw", GatewayMetrics(), spill_requests=8)
    holder = link(ctx, "holder", CHAIN, active=9)
    idle = link(ctx, "idle", [])
    assert router.pick([holder, idle], "m", submit()) is idle


def test_decode_load_outweighs_a_short_match(ctx: zmq.Context) -> None:
    router = PrefixRouter("gw", GatewayMetrics(), overlap_weight=1.0)
    holder = link(ctx, "holder", CHAIN[:2], active=2, used_blocks=40)
    idle = link(ctx, "idle", [])
    assert router.pick([holder, idle], "m", submit()) is idle


def test_with_no_match_anywhere_the_least_loaded_wins_and_ties_go_either_way(ctx: zmq.Context) -> None:
    router = PrefixRouter("gw", GatewayMetrics())
    busy, quiet = link(ctx, "busy", [], active=2), link(ctx, "quiet", [])
    assert router.pick([busy, quiet], "m", submit()) is quiet
    a, b = link(ctx, "a", []), link(ctx, "b", [])
    assert {router.pick([a, b], "m", submit()) for _ in range(40)} == {a, b}


def test_least_loaded_and_salted_prompts_ignore_the_caches(ctx: zmq.Context) -> None:
    holder, quiet = link(ctx, "holder", CHAIN, active=1), link(ctx, "quiet", [])
    assert PrefixRouter("gw", GatewayMetrics(), "least-loaded").pick([holder, quiet], "m", submit()) is quiet
    holder.lora_adapters = quiet.lora_adapters = frozenset({"a"})  # its blocks are salted by the adapter
    under_lora = submit(lora="a")
    assert PrefixRouter("gw", GatewayMetrics()).pick([holder, quiet], "m", under_lora) is quiet
    with pytest.raises(ValueError, match="unknown router 'random'"):
        PrefixRouter("gw", GatewayMetrics(), "random")  # type: ignore[arg-type]


def test_routing_counts_prompt_and_matched_blocks_per_worker(ctx: zmq.Context) -> None:
    metrics = GatewayMetrics()
    router = PrefixRouter("gw", metrics)
    holder = link(ctx, "holder", CHAIN[:6])
    router.pick([holder], "m", submit())
    router.pick([holder], "m", submit())
    value = metrics.registry.get_sample_value
    assert value("tokenwire_gateway_prefix_prompt_blocks_total", {"worker": "holder"}) == 20
    assert value("tokenwire_gateway_prefix_matched_blocks_total", {"worker": "holder"}) == 12


def test_a_gap_in_the_events_asks_the_worker_for_a_snapshot(ctx: zmq.Context) -> None:
    worker = ctx.socket(zmq.ROUTER)
    worker.setsockopt(zmq.LINGER, 0)
    worker.bind("inproc://prefix-router-worker")
    metrics = GatewayMetrics()
    router = PrefixRouter("gw", metrics)
    w = link(ctx, "w", [])
    w.socket.connect("inproc://prefix-router-worker")
    try:
        router.kv_message(w, protocol.KvEvents(sender_id="w", incarnation="i", seq=1, stored=CHAIN[:3]))
        router.kv_message(w, protocol.KvEvents(sender_id="w", incarnation="i", seq=3, stored=CHAIN[5:6]))
        assert worker.poll(5000)
        _, data = worker.recv_multipart()
        assert protocol.decode(data) == protocol.KvSnapshotRequest(sender_id="gw")
        router.kv_message(w, protocol.KvSnapshot(sender_id="w", incarnation="i", seq=3, block_size=BLOCK,
                                                 hashes=CHAIN[:6]))  # fmt: skip
        assert w.kv.matched(CHAIN) == (6, 0)
        assert metrics.registry.get_sample_value("tokenwire_gateway_prefix_index_blocks", {"worker": "w"}) == 6
        router.forget(w)
        assert metrics.registry.get_sample_value("tokenwire_gateway_prefix_index_blocks", {"worker": "w"}) is None
    finally:
        worker.close(0)
