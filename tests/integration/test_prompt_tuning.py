"""Prompt tuning through the service: a request's embedding table travels in its Submit,
and prompt ids past the vocabulary take its rows."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import protocol
from tests.integration.wire import WireClient
from tests.procs import Stack, stack


@pytest.fixture(scope="module")
def service(service_model: Path, redis_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with stack(service_model, redis_server.url, tmp_path_factory.mktemp("prompt-tuning")) as s:
        yield s


@pytest.fixture
def wire(service: Stack) -> Iterator[WireClient]:
    w = WireClient(service.gateways[0].endpoint)
    yield w
    w.close()


def submit(request_id: str, ids: list[int], table: np.ndarray | None = None) -> protocol.Submit:
    config = None if table is None else protocol.PromptTuningConfig(
        embedding_table=protocol.Logits(shape=list(table.shape), data=table.astype("<f4").tobytes()))
    return protocol.Submit(request_id=request_id, input_token_ids=ids, max_tokens=6, end_id=-1,
                           sampling_config=protocol.SamplingConfig(temperature=0.0), prompt_tuning_config=config)


def test_table_rows_equal_to_embeddings_give_the_same_output_as_their_ids(service: Stack, wire: WireClient,
                                                                          service_model: Path):  # fmt: skip
    vocab = json.loads((service_model / "config.json").read_text())["vocab_size"]
    (weights,) = [load_file(f) for f in service_model.glob("*.safetensors")]
    table = weights["model.embed_tokens.weight"][[7, 8, 9]]
    wire.send(submit("ids", [5, 6, 7, 8, 9]))
    wire.send(submit("table", [5, 6, vocab, vocab + 1, vocab + 2], table))
    wire.send(submit("other-rows", [5, 6, vocab + 2, vocab + 1, vocab], table))
    wire.wait(["ids", "table", "other-rows"], timeout=60)
    outputs = {r: wire.responses[r][-1].result for r in ("ids", "table", "other-rows")}
    assert all(out is not None for out in outputs.values()), wire.responses
    tokens = {r: out.output_token_ids[0] for r, out in outputs.items() if out is not None}
    assert tokens["table"] == tokens["ids"]
    assert tokens["other-rows"] != tokens["ids"]


def test_ids_past_the_table_are_refused_for_that_request(service: Stack, wire: WireClient, service_model: Path):
    vocab = json.loads((service_model / "config.json").read_text())["vocab_size"]
    hidden = json.loads((service_model / "config.json").read_text())["hidden_size"]
    wire.send(submit("past", [5, vocab + 2], np.zeros((2, hidden), np.float32)))
    error = wire.wait_error()
    assert error.request_id == "past"
    assert f"token id {vocab + 2} is outside the vocabulary and the prompt-tuning table [0, {vocab} + 2)" in (
        error.message
    )
    wire.send(submit("narrow", [5, vocab], np.zeros((1, hidden - 1), np.float32)))
    wire.wait(["narrow"], timeout=30)
    (narrow,) = wire.responses["narrow"]
    assert narrow.error_msg is not None and f"hidden size is {hidden}" in narrow.error_msg  # the executor checks it
