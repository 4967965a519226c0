"""Routing among a gateway's workers: by model, by LoRA adapter held (else loadable), then by load."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

import protocol
from gateway.workers import WorkerLink, adapter_models, least_loaded


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


@pytest.fixture
def links(ctx: zmq.Context) -> Iterator[list[WorkerLink]]:
    made: list[WorkerLink] = []

    def link(worker_id: str, model: str, adapters: set[str], busy: int, loadable: frozenset[str] = frozenset()
             ) -> WorkerLink:  # fmt: skip
        info = protocol.WorkerInfo(worker_id=worker_id, address="tcp://127.0.0.1:1", models=[model], host="h",
                                   pid=1, started_at=0.0)  # fmt: skip
        w = WorkerLink(info, ctx.socket(zmq.DEALER), ready=True, models=[model], lora_adapters=frozenset(adapters),
                       load=protocol.WorkerLoad(num_active_requests=busy), lora_loadable=loadable)  # fmt: skip
        made.append(w)
        return w

    link("idle-plain", "m", set(), 0)
    link("busy-a", "m", {"a"}, 5)
    link("busier-ab", "m", {"a", "b"}, 9)
    link("other-model-c", "n", {"c"}, 0)
    link("busiest-can-load-bd", "m", set(), 12, frozenset({"b", "d"}))
    link("busier-can-load-de", "m", set(), 10, frozenset({"d", "e"}))
    link("other-model-can-load-f", "n", set(), 0, frozenset({"f"}))
    yield made
    for w in made:
        w.socket.close(0)


def test_an_adapter_request_goes_to_the_least_loaded_worker_holding_it(links: list[WorkerLink]):
    assert least_loaded(links, "m", "a").worker_id == "busy-a"  # type: ignore[union-attr]
    assert least_loaded(links, "m", "b").worker_id == "busier-ab"  # type: ignore[union-attr]
    assert least_loaded(links, None, "c").worker_id == "other-model-c"  # type: ignore[union-attr]


def test_no_worker_holding_the_adapter_means_none(links: list[WorkerLink]):
    assert least_loaded(links, "m", "c") is None  # held, but by a worker of another model
    assert least_loaded(links, "m", "zzz") is None


def test_without_an_adapter_any_worker_of_the_model_serves(links: list[WorkerLink]):
    assert least_loaded(links, "m").worker_id == "idle-plain"  # type: ignore[union-attr]


def test_draining_workers_are_not_chosen_or_listed(links: list[WorkerLink]):
    links[1].draining = True
    assert least_loaded(links, "m", "a").worker_id == "busier-ab"  # type: ignore[union-attr]
    links[2].draining = True
    assert least_loaded(links, "m", "a") is None
    for w in links[4:]:
        w.draining = True
    assert adapter_models(links) == {"c": "n"}


def test_adapters_map_to_their_models(links: list[WorkerLink]):
    assert adapter_models(links) == {"a": "m", "b": "m", "c": "n", "d": "m", "e": "m", "f": "n"}


def test_a_worker_holding_the_adapter_wins_over_a_less_loaded_one_that_could_load_it(links: list[WorkerLink]):
    links[4].load = protocol.WorkerLoad()  # idle, and it can load b
    assert links[2].score() > links[4].score()
    assert least_loaded(links, "m", "b").worker_id == "busier-ab"  # type: ignore[union-attr]
    links[2].draining = True  # the only holder: now the one that can load it
    assert least_loaded(links, "m", "b").worker_id == "busiest-can-load-bd"  # type: ignore[union-attr]


def test_if_none_holds_it_the_least_loaded_worker_that_can_load_it(links: list[WorkerLink]):
    assert least_loaded(links, "m", "d").worker_id == "busier-can-load-de"  # type: ignore[union-attr]
    links[4].sent_since_load = 0
    links[5].sent_since_load = 3  # sent meanwhile: now the busier of the two
    assert least_loaded(links, "m", "d").worker_id == "busiest-can-load-bd"  # type: ignore[union-attr]
    assert least_loaded(links, None, "f").worker_id == "other-model-can-load-f"  # type: ignore[union-attr]
    assert least_loaded(links, "m", "f") is None  # loadable, but by a worker of another model


def test_once_loaded_it_is_held_there(links: list[WorkerLink]):
    w = links[5]
    w.lora_adapters, w.lora_loadable = frozenset({"e"}), frozenset({"d"})  # as its LoraAdapters notice says
    links[4].load = protocol.WorkerLoad()  # idle now, and it could load e too
    links[4].lora_loadable = frozenset({"b", "d", "e"})
    assert least_loaded(links, "m", "e") is w


@pytest.mark.parametrize("batches", [True, False])
def test_submits_wait_for_the_turns_end_where_the_worker_takes_batches(ctx: zmq.Context, batches: bool):
    worker = ctx.socket(zmq.PAIR)
    worker.bind("inproc://worker-link-test")
    sock = ctx.socket(zmq.PAIR)
    sock.connect("inproc://worker-link-test")
    info = protocol.WorkerInfo(worker_id="w", address="inproc://worker-link-test", models=["m"], host="h", pid=1,
                               started_at=0.0)  # fmt: skip
    link = WorkerLink(info, sock, ready=True, submit_batches=batches)
    submits = [protocol.encode(protocol.Submit(request_id=f"r{i}", input_token_ids=[1], max_tokens=2))
               for i in range(3)]  # fmt: skip
    try:
        for data in submits:
            link.submit(data)
        assert bool(worker.poll(50)) is not batches  # queued until the turn ends, or sent at once
        link.send(protocol.encode(protocol.Cancel(request_id="r1")))  # after the submits it may be about
        link.flush()
        got = []
        while worker.poll(50):
            got.append(protocol.decode(worker.recv()))
        if batches:
            assert [type(m) for m in got] == [protocol.SubmitBatch, protocol.Cancel]
            assert isinstance(got[0], protocol.SubmitBatch) and got[0].submits == submits
        else:
            assert [type(m) for m in got] == [protocol.Submit] * 3 + [protocol.Cancel]
        assert not link.pending
    finally:
        sock.close(0)
        worker.close(0)
