"""Which requests a gateway splits over a prefill and a decode worker, and which two
workers it picks (gateway/disagg.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import pytest
import zmq

import protocol
from gateway.disagg import pick_pair, splits, whole_request_workers
from gateway.prefix_router import PrefixRouter
from gateway.workers import WorkerLink
from ops.metrics import GatewayMetrics


def submit(**fields: Any) -> protocol.Submit:
    return protocol.Submit(**{"request_id": "r", "input_token_ids": list(range(1, 40)), "max_tokens": 16,
                              "streaming": True, **fields})  # fmt: skip


@pytest.fixture
def link() -> Iterator[Any]:
    ctx = zmq.Context()
    made: list[WorkerLink] = []

    def make(worker_id: str, role: Literal["prefill", "decode", "both"], kv: bool, busy: int = 0) -> WorkerLink:
        kv_address = "tcp://127.0.0.1:2" if kv else None
        info = protocol.WorkerInfo(worker_id=worker_id, address="tcp://127.0.0.1:1", models=["m"], host="h", pid=1,
                                   started_at=0.0, role=role, kv_address=kv_address)  # fmt: skip
        w = WorkerLink(info, ctx.socket(zmq.DEALER), ready=True, models=["m"],
                       load=protocol.WorkerLoad(num_active_requests=busy))  # fmt: skip
        made.append(w)
        return w

    yield make
    for w in made:
        w.socket.close(0)
    ctx.term()


def test_only_new_streamed_continuable_requests_of_more_than_one_token_are_split() -> None:
    assert splits(submit())
    assert not splits(submit(streaming=False))
    assert not splits(submit(max_tokens=1))
    assert not splits(submit(resumed_token_ids=[5], max_tokens=16))
    assert not splits(submit(lora_config=protocol.LoraConfig(name="a")))
    assert not splits(submit(num_return_sequences=2, sampling_config=protocol.SamplingConfig(top_k=5)))
    assert not splits(submit(input_token_ids=None, prompt="text not tokenized yet"))


def test_the_pair_is_a_prefill_worker_and_the_least_loaded_worker_taking_kv_blocks(link: Any) -> None:
    prefill = link("p", "prefill", False)
    busy_decode = link("d1", "decode", True, busy=5)
    idle_decode = link("d2", "decode", True, busy=1)
    both = link("b", "both", False, busy=0)  # takes no KV blocks: never a decode worker, and prefills nothing
    router = PrefixRouter("gw", GatewayMetrics())
    workers = [prefill, busy_decode, idle_decode, both]
    assert pick_pair(router, workers, "m", submit()) == (prefill, idle_decode)
    assert pick_pair(router, [busy_decode, idle_decode], "m", submit()) is None  # no prefill worker
    assert pick_pair(router, [prefill], "m", submit()) is None  # no decode worker


def test_whole_requests_go_to_decode_only_workers_only_when_nothing_else_serves(link: Any) -> None:
    decode, both = link("d", "decode", True), link("b", "both", True)
    assert whole_request_workers([decode, both]) == [both]
    assert whole_request_workers([decode]) == [decode]
