"""A bare DEALER speaking the wire protocol, for tests that must see every message."""

from __future__ import annotations

import time
from collections import defaultdict

import zmq

import protocol


class WireClient:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.responses: dict[str, list[protocol.Response]] = defaultdict(list)
        self.errors: dict[str, list[protocol.ErrorReply]] = defaultdict(list)
        self.other: list[protocol.Message] = []

    def send(self, msg: protocol.Message) -> None:
        self.sock.send(protocol.encode(msg))

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def hello(self) -> protocol.Ready:
        self.send(protocol.Hello(sender_id="wire-test", role="client", heartbeat_interval_s=1.0))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            self.pump(0.1)
            ready = [m for m in self.other if isinstance(m, protocol.Ready)]
            if ready:
                return ready[0]
        raise AssertionError("no Ready from the gateway")

    def pump(self, timeout: float) -> None:
        """Receive whatever arrives within `timeout` seconds; keep a heartbeat going."""
        if self.sock.poll(int(timeout * 1000)):
            while True:
                try:
                    msg = protocol.decode(self.sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, protocol.ResultBatch):
                    for r in msg.all_responses():
                        self.responses[r.request_id].append(r)
                elif isinstance(msg, protocol.ErrorReply) and msg.request_id:
                    self.errors[msg.request_id].append(msg)
                elif isinstance(msg, protocol.Heartbeat):
                    self.send(protocol.Heartbeat(sender_id="wire-test"))
                else:
                    self.other.append(msg)

    def finished(self, request_id: str) -> bool:
        return bool(self.errors.get(request_id)) or any(
            r.is_final for r in self.responses.get(request_id, [])
        )

    def wait(self, request_ids: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.finished(i) for i in request_ids):
            if time.monotonic() > deadline:
                missing = [i for i in request_ids if not self.finished(i)]
                raise AssertionError(
                    f"{len(missing)} requests unfinished after {timeout} s, e.g. {missing[:3]}"
                )
            self.pump(0.05)

    def wait_error(self, timeout: float = 10.0) -> protocol.ErrorReply:
        """The next error reply, with or without a request id."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pump(0.05)
            for m in self.other:
                if isinstance(m, protocol.ErrorReply):
                    self.other.remove(m)
                    return m
            for errors in self.errors.values():
                if errors:
                    return errors.pop(0)
        raise AssertionError(f"no error reply within {timeout} s")

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
