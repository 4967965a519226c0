"""Routing among a gateway's workers: by model, by LoRA adapter held, then by load."""

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

    def link(worker_id: str, model: str, adapters: set[str], busy: int) -> WorkerLink:
        info = protocol.WorkerInfo(worker_id=worker_id, address="tcp://127.0.0.1:1", models=[model], host="h",
                                   pid=1, started_at=0.0)  # fmt: skip
        w = WorkerLink(info, ctx.socket(zmq.DEALER), ready=True, models=[model], lora_adapters=frozenset(adapters),
                       load=protocol.WorkerLoad(num_active_requests=busy))  # fmt: skip
        made.append(w)
        return w

    link("idle-plain", "m", set(), 0)
    link("busy-a", "m", {"a"}, 5)
    link("busier-ab", "m", {"a", "b"}, 9)
    link("other-model-c", "n", {"c"}, 0)
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
    assert adapter_models(links) == {"c": "n"}


def test_adapters_map_to_their_models(links: list[WorkerLink]):
    assert adapter_models(links) == {"a": "m", "b": "m", "c": "n"}
