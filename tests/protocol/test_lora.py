"""LoRA and prompt tuning on the wire: a request names its adapter, carries its prompt
table; workers announce their adapters and take loads and unloads."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

import protocol as p
from protocol.packed import pack_floats


def decode_payload(kind: str, payload: Any) -> p.Message:
    return p.decode(msgpack.packb([1, kind, payload], use_bin_type=True))


def table(rows: int, hidden: int, data: bytes | None = None) -> dict[str, Any]:
    values = [float(i) for i in range(rows * hidden)]
    return {"embedding_table": {"shape": [rows, hidden], "data": pack_floats(values) if data is None else data}}


def test_a_submit_names_its_adapter_and_carries_its_prompt_table():
    payload = {"request_id": "r", "input_token_ids": [1, 2, 100], "max_tokens": 4,
               "lora_config": {"name": "sql"}, "prompt_tuning_config": table(2, 3)}  # fmt: skip
    msg = decode_payload("submit", payload)
    assert isinstance(msg, p.Submit)
    assert msg.lora == "sql"
    assert msg.prompt_tuning_config is not None and msg.prompt_tuning_config.rows == 2
    assert p.decode(p.encode(msg)) == msg


def test_no_adapter_is_the_default_and_costs_nothing_on_the_wire():
    msg = p.Submit(request_id="r", input_token_ids=[1], max_tokens=1)
    assert msg.lora is None
    assert b"lora" not in p.encode(msg)


@pytest.mark.parametrize(
    ("config", "rule"),
    [
        (table(2, 3, data=b"\x00" * 20), "data is 20 bytes; shape [2, 3] needs 24"),
        ({"embedding_table": {"shape": [6], "data": b"\x00" * 24}}, "must be [rows, hidden]"),
        ({"embedding_table": {"shape": [0, 3], "data": b""}}, "must be [rows, hidden]"),
    ],
)
def test_a_prompt_table_of_the_wrong_size_is_refused(config: dict[str, Any], rule: str):
    payload = {"request_id": "r", "input_token_ids": [1], "max_tokens": 4, "prompt_tuning_config": config}
    with pytest.raises(p.ProtocolError, match="prompt_tuning_config") as info:
        decode_payload("submit", payload)
    assert rule in str(info.value)
    assert info.value.request_id == "r"


def test_a_prompt_table_needs_token_ids():
    payload = {"request_id": "r", "prompt": "hi", "max_tokens": 4, "prompt_tuning_config": table(1, 2)}
    with pytest.raises(p.ProtocolError, match="prompt_tuning_config needs input_token_ids"):
        decode_payload("submit", payload)


def test_workers_announce_their_adapters():
    ready = p.Ready(sender_id="w", role="worker", heartbeat_interval_s=1.0, models=["m"], lora_adapters=["a", "b"],
                    lora_loadable=["c"])  # fmt: skip
    assert p.decode(p.encode(ready)) == ready
    info = p.WorkerInfo(worker_id="w", address="tcp://h:1", models=["m"], host="h", pid=1, started_at=0.0,
                        lora_adapters=["a"], lora_loadable=["c", "d"])  # fmt: skip
    assert p.decode(p.encode(info)) == info
    news = p.LoraAdapters(sender_id="w", adapters=["a"], loadable=["c"], request_id="q")
    assert p.decode(p.encode(news)) == news


def test_an_older_peer_announces_nothing_loadable():
    """lora_loadable is optional: a message without it (an older worker's) decodes as loading nothing."""
    payload = {"sender_id": "w", "role": "worker", "heartbeat_interval_s": 1.0, "lora_adapters": ["a"]}
    ready = decode_payload("ready", payload)
    assert isinstance(ready, p.Ready) and ready.lora_adapters == ["a"] and ready.lora_loadable == []


@pytest.mark.parametrize(
    ("kind", "payload", "where"),
    [
        ("lora_load", {"request_id": "q", "name": "a", "path": ""}, "path"),
        ("lora_load", {"request_id": "q", "name": "", "path": "/x"}, "name"),
        ("lora_load", {"request_id": "q", "name": "a"}, "path"),
        ("lora_unload", {"name": "a"}, "request_id"),
    ],
)
def test_bad_loads_and_unloads_are_refused(kind: str, payload: dict[str, Any], where: str):
    with pytest.raises(p.ProtocolError, match=f"invalid {kind}: .*{where}"):
        decode_payload(kind, payload)
