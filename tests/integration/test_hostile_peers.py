"""CURVE off, binds on loopback (the defaults): a local peer sending malformed
frames is answered and counted, and one that takes the gateway's name (Redis
shows it) gets none of the gateway's requests and is refused and logged."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest
import zmq

import protocol
from clients.client import Client
from tests.integration.test_metrics import scrape, value
from tests.integration.wire import WireClient
from tests.procs import CLIENT_OPTIONS, HEARTBEAT_S, Stack, free_port

SUBMIT = protocol.encode(protocol.Submit(request_id="mangled", input_token_ids=[5, 6, 7], max_tokens=4))
MALFORMED = {
    "truncated": SUBMIT[:-2],
    "trailing bytes": SUBMIT + b"\x01\x02",
    "truncated before its id": SUBMIT[:6],
    "a second message behind the first": SUBMIT + SUBMIT,
    "empty": b"",
    "a lone map header": msgpack.packb({"request_id": "x"})[:1],
}


@pytest.fixture(scope="module")
def plain(service_model: Path, redis_server, tmp_path_factory: pytest.TempPathFactory):
    ports = {"worker": free_port(), "gateway": free_port()}
    s = Stack(service_model, redis_server.url, tmp_path_factory.mktemp("hostile"))
    try:
        s.worker("--metrics-port", str(ports["worker"]))
        s.gateway("--metrics-port", str(ports["gateway"]))
        s.gateways[0].wait_workers(1)
        yield s, ports
    finally:
        s.close()


@pytest.mark.parametrize("to", ["gateway", "worker"])
def test_every_malformed_frame_is_answered_and_counted(plain, to: str) -> None:
    s, ports = plain
    endpoint = s.gateways[0].endpoint if to == "gateway" else s.workers[0].endpoint
    before = value(scrape(ports[to]), f"tokenwire_{to}_protocol_errors_total")
    wire = WireClient(endpoint)
    try:
        for name, frame in MALFORMED.items():
            wire.send_raw(frame)
            reply = wire.wait_error()
            assert reply.code == protocol.ErrorCode.PROTOCOL, name
            assert "malformed msgpack" in reply.message, (name, reply.message)
    finally:
        wire.close()
    after = value(scrape(ports[to]), f"tokenwire_{to}_protocol_errors_total")
    assert after - before == len(MALFORMED)
    with Client([s.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
        assert len(client.generate([5, 6, 7], max_tokens=4, timeout=30).token_ids) == 4


def test_a_peer_taking_the_gateways_public_name_gets_nothing(plain) -> None:
    s, _ = plain
    worker, gateway = s.workers[0], s.gateways[0]
    ctx = zmq.Context()
    try:
        with Client([gateway.endpoint], **CLIENT_OPTIONS) as client:
            first = client.generate([5, 6, 7], max_tokens=4, timeout=30)
            name = s.request_stats(first.request_id)["gateway"]  # public: anyone reading Redis sees it
            assert name == gateway.gateway_id
            stream = client.stream([5, 6, 7], max_tokens=300, min_tokens=300, temperature=0.0)
            next(iter(stream))

            thief = ctx.socket(zmq.DEALER)
            thief.setsockopt(zmq.LINGER, 0)
            thief.setsockopt(zmq.IDENTITY, name.encode())
            thief.connect(worker.endpoint)
            hello = protocol.Hello(sender_id=name, role="gateway", heartbeat_interval_s=HEARTBEAT_S)
            thief.send(protocol.encode(hello))
            worker.wait_log(f"worker: refused an identity takeover: '{name}'", timeout=30)

            assert len(stream.result(timeout=60).token_ids) == 300  # the real client's stream ends whole
            time.sleep(3 * HEARTBEAT_S)  # the worker's heartbeats would have reached the thief by now
            assert not thief.poll(0), "the thief was answered"
        assert "dropped this request" not in gateway.log()
    finally:
        ctx.destroy(0)
