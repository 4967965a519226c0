"""What a worker sees of two clients that chose the same request id, seen from a
bare worker peer on the wire (registered in Redis like a worker): one id each
toward it, the client's id named in `client_request_id` where they differ, and
everything it sends back (columns, whole responses, cancels, errors) reaching
the right client under the client's id."""

from __future__ import annotations

import os
import socket
import time

import pytest
import redis
import zmq

import protocol
from tests.integration.wire import WireClient
from tests.procs import HEARTBEAT_S, Gateway


class WorkerPeer:
    """A ROUTER that registers as worker 'peer' and answers Hello; nothing more. With
    `submit_batches` its Ready says it takes SubmitBatch messages: their submits are
    received one by one, and each batch's size kept in `batches`."""

    def __init__(self, redis_url: str, submit_batches: bool = False) -> None:
        self.submit_batches = submit_batches
        self.batches: list[int] = []
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.gateway: bytes | None = None
        self.received: list[protocol.Message] = []
        keys = protocol.Keys()
        info = protocol.WorkerInfo(worker_id="peer", address=f"tcp://127.0.0.1:{port}", models=["m"],
                                   host=socket.gethostname(), pid=os.getpid(), started_at=time.time())  # fmt: skip
        self.redis = redis.Redis.from_url(redis_url)
        self.redis.set(keys.worker("peer"), protocol.encode(info), px=60_000)
        self.redis.zadd(keys.workers(), {"peer": time.time()})

    def send(self, msg: protocol.Message) -> None:
        assert self.gateway is not None
        self.sock.send_multipart([self.gateway, protocol.encode(msg)])

    def pump(self, until: float) -> None:
        deadline = time.monotonic() + until
        while time.monotonic() < deadline:
            if self.gateway is not None:
                self.send(protocol.Heartbeat(sender_id="peer"))
            if not self.sock.poll(50):
                continue
            gateway, payload = self.sock.recv_multipart()
            msg = protocol.decode(payload)
            if isinstance(msg, protocol.Hello):
                self.gateway = gateway
                ready = protocol.Ready(sender_id="peer", role="worker", heartbeat_interval_s=HEARTBEAT_S, models=["m"],
                                       submit_batches=self.submit_batches)  # fmt: skip
                self.send(ready)
            elif isinstance(msg, protocol.SubmitBatch):
                self.batches.append(len(msg.submits))
                self.received += [protocol.decode(item) for item in msg.submits]
            elif not isinstance(msg, protocol.Heartbeat):
                self.received.append(msg)

    def wait_for(self, kind: type[protocol.Message], count: int, timeout: float = 10.0) -> list[protocol.Message]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = [m for m in self.received if isinstance(m, kind)]
            if len(got) >= count:
                return got
            self.pump(0.05)
        raise AssertionError(f"{count} {kind.__name__} not received within {timeout} s: {self.received}")

    def close(self) -> None:
        # Leave the registry as found: a later module's gateway sharing this Redis would
        # connect to the gone peer and log it lost.
        keys = protocol.Keys()
        self.redis.delete(keys.worker("peer"))
        self.redis.zrem(keys.workers(), "peer")
        self.redis.close()
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def peer_and_gateway(redis_url, tmp_path):
    peer = WorkerPeer(redis_url)
    gateway = Gateway("gw-ids", redis_url, tmp_path)
    try:
        deadline = time.monotonic() + 30
        while peer.gateway is None:
            assert time.monotonic() < deadline, gateway.log()
            peer.pump(0.1)
        yield peer, gateway
    finally:
        gateway.stop()
        peer.close()


def _result(tokens: list[int], final: bool) -> protocol.Result:
    reason = protocol.FinishReason.LENGTH if final else protocol.FinishReason.NOT_FINISHED
    return protocol.Result(is_final=final, is_sequence_final=final, output_token_ids=[tokens], finish_reasons=[reason])


def test_same_request_id_from_two_clients_is_two_requests_on_the_wire(peer_and_gateway):
    peer, gateway = peer_and_gateway
    a, b = WireClient(gateway.endpoint), WireClient(gateway.endpoint)
    try:
        for c in (a, b):
            c.hello()
        a.send(protocol.Submit(request_id="x", input_token_ids=[1, 2], max_tokens=4, streaming=True))
        peer.wait_for(protocol.Submit, 1)
        b.send(protocol.Submit(request_id="x", input_token_ids=[3], max_tokens=4, streaming=True,
                               client_request_id="spoofed"))  # fmt: skip
        first, second = peer.wait_for(protocol.Submit, 2)
        assert isinstance(first, protocol.Submit) and isinstance(second, protocol.Submit)
        assert (first.request_id, first.client_request_id, first.input_token_ids) == ("x", None, [1, 2])
        assert second.request_id != "x" and second.client_request_id == "x" and second.input_token_ids == [3]

        columns = protocol.StreamedTokens(request_ids=[second.request_id, "x", second.request_id],
                                          counts=[1, 2, 1], token_ids=[7, 8, 9, 10])  # fmt: skip
        peer.send(protocol.ResultBatch(streamed=columns))
        b.send(protocol.Cancel(request_id="x"))
        (cancel,) = peer.wait_for(protocol.Cancel, 1)
        assert isinstance(cancel, protocol.Cancel) and cancel.request_id == second.request_id
        peer.send(protocol.ResultBatch(responses=[  # a plain step whole, as older workers send them
            protocol.Response(request_id="x", result=_result([12], False)),
            protocol.Response(request_id=second.request_id, result=_result([], True)),
            protocol.Response(request_id="x", result=_result([11], True)),
        ]))  # fmt: skip
        a.wait(["x"], timeout=10)
        b.wait(["x"], timeout=10)
        got = {name: [(r.request_id, r.result.output_token_ids[0], r.is_final) for r in c.responses["x"] if r.result]
               for name, c in (("a", a), ("b", b))}  # fmt: skip
        assert got == {
            "a": [("x", [8, 9], False), ("x", [12], False), ("x", [11], True)],
            "b": [("x", [7], False), ("x", [10], False), ("x", [], True)],
        }

        # The wire id is free again: the next request with it goes by the client's id.
        b.send(protocol.Submit(request_id="x", input_token_ids=[4], max_tokens=4))
        third = peer.wait_for(protocol.Submit, 3)[2]
        assert isinstance(third, protocol.Submit) and (third.request_id, third.client_request_id) == ("x", None)
        a.send(protocol.Submit(request_id="x", input_token_ids=[5], max_tokens=4))
        fourth = peer.wait_for(protocol.Submit, 4)[3]
        assert isinstance(fourth, protocol.Submit) and fourth.client_request_id == "x"
        peer.send(protocol.ErrorReply(code=protocol.ErrorCode.INTERNAL, message="boom", request_id=fourth.request_id))
        deadline = time.monotonic() + 10
        while not a.errors.get("x") and time.monotonic() < deadline:
            a.pump(0.05)
        (error,) = a.errors["x"]
        assert (error.request_id, error.message) == ("x", "boom")
        assert not b.errors
    finally:
        a.close()
        b.close()


def test_a_wire_id_is_taken_until_the_worker_ends_what_the_gateway_cancelled(peer_and_gateway):
    peer, gateway = peer_and_gateway
    a = WireClient(gateway.endpoint)
    a.hello()
    a.send(protocol.Submit(request_id="y", input_token_ids=[1], max_tokens=4, streaming=True))
    (first,) = peer.wait_for(protocol.Submit, 1)
    a.close()  # silent: the gateway ends its request and cancels it at the worker
    (cancel,) = peer.wait_for(protocol.Cancel, 1, timeout=15)
    assert isinstance(first, protocol.Submit) and isinstance(cancel, protocol.Cancel)
    assert first.request_id == cancel.request_id == "y"
    b = WireClient(gateway.endpoint)
    try:
        b.hello()
        b.send(protocol.Submit(request_id="y", input_token_ids=[2], max_tokens=4, streaming=True))
        second = peer.wait_for(protocol.Submit, 2)[1]
        assert isinstance(second, protocol.Submit)
        assert second.request_id != "y" and second.client_request_id == "y"  # the worker still runs "y"
        reasons = [protocol.FinishReason.CANCELLED]
        cancelled = protocol.Result(is_final=True, output_token_ids=[[]], finish_reasons=reasons)
        peer.send(protocol.ResultBatch(responses=[
            protocol.Response(request_id="y", result=cancelled),  # the worker has ended a's
            protocol.Response(request_id=second.request_id, result=_result([3], True)),
        ]))  # fmt: skip
        b.wait(["y"], timeout=10)
        assert [r.result.output_token_ids for r in b.responses["y"] if r.result] == [[[3]]]
        b.send(protocol.Submit(request_id="y", input_token_ids=[4], max_tokens=4))
        third = peer.wait_for(protocol.Submit, 3)[2]
        assert isinstance(third, protocol.Submit) and (third.request_id, third.client_request_id) == ("y", None)
    finally:
        b.close()
