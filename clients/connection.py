"""The client library's I/O thread: one DEALER to one gateway at a time.

Threading choice: every socket is owned by this one thread. Callers on any
thread hand it commands through a queue and wake it through a pipe the poller
watches, so `Client` and `AsyncClient` are safe to share between threads and
submitting never waits on the network.

Failover: a gateway that does not answer Hello within `connect_timeout_s`,
stops heartbeating for `missed_heartbeats` intervals, or whose connection closes
after it answered (its process died), is dropped for the next one in the list.
Requests that had received nothing yet are sent again there; streams that had
started go on there as continuations (protocol/continuation.py: the request again,
with every token received so far), so the caller sees one stream, no token twice;
those a continuation cannot carry on (beams, several sequences, log probs) fail
with `GatewayLostError`. When every gateway has failed to answer
`connect_attempts` times in a row, the requests waiting fail with
`GatewayUnavailableError`, which names the addresses tried, and so do new ones
until a gateway answers (the connection keeps trying in the background).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

import protocol
from ops.curve import ClientCurve, connect_as_client
from protocol.api_keys import API_KEY_ENV
from protocol.continuation import not_resumable
from protocol.limits import socket_turn

log = logging.getLogger(__name__)

class RequestError(RuntimeError):
    """The service answered this request with an error."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
        self.request_id = request_id

    def __reduce__(self) -> tuple[type[RequestError], tuple[str, str, str | None]]:
        # Picklable as it was made (the default re-calls __init__ with the formatted text alone):
        # an error raised in a process pool's worker reaches the caller whole.
        return type(self), (self.code, self.message, self.request_id)


class GatewayLostError(RequestError):
    """The gateway stopped answering after this request had started streaming."""


class GatewayUnavailableError(RequestError):
    """No gateway of the list answered."""


class Sink(Protocol):
    """Where one request's news goes; called on the I/O thread, must not block."""

    def on_response(self, response: protocol.Response) -> None: ...

    def on_error(self, error: RequestError) -> None: ...


@dataclass(eq=False, slots=True)
class _Call:
    request_id: str
    submit: protocol.Submit
    payload: bytes  # the submit's bytes, as sent
    sink: Sink
    started: bool = False
    # Every token received, where a continuation can carry the stream on after a failover.
    received: list[int] | None = None


class Connection(threading.Thread):
    def __init__(
        self,
        gateways: Sequence[str],
        *,
        heartbeat_interval_s: float = 1.0,
        missed_heartbeats: int = 3,
        connect_timeout_s: float = 2.0,
        connect_attempts: int | None = 2,  # None: keep trying (a daemon that waits for its gateways)
        curve: ClientCurve | None = None,  # CURVE on: the gateways are CURVE servers with this key
        api_key: str | None = None,  # for gateways with API keys on and CURVE off; default $TOKENWIRE_API_KEY
    ) -> None:
        super().__init__(name="tokenwire-client-io", daemon=True)
        if isinstance(gateways, str) or not gateways:
            raise ValueError("gateways must be a non-empty list of ZeroMQ endpoints, e.g. ['tcp://127.0.0.1:5550']")
        self.gateways = list(gateways)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.missed_heartbeats = missed_heartbeats
        self.connect_timeout_s = connect_timeout_s
        self.connect_attempts = connect_attempts
        self.curve = curve
        self.api_key = api_key or os.environ.get(API_KEY_ENV) or None
        self._failed_opens = 0  # gateways opened in a row that never answered
        self.client_id = f"client-{uuid.uuid4().hex[:12]}"
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        # A wake byte is on its way: a burst of submits from asyncio costs one write, not one each.
        self._waking = False
        self._ctx = zmq.Context()
        self._calls: dict[str, _Call] = {}
        self._index = -1
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None  # the socket's disconnect events
        self._poller = zmq.Poller()
        self._ready = False
        self._opened = 0.0
        self._last_seen = 0.0
        self._gateway_interval_s = heartbeat_interval_s
        self._closed = threading.Event()
        self.gateway: str | None = None  # the endpoint in use, for diagnostics
        self.start()

    # -- any thread ---------------------------------------------------------------------

    def submit(self, msg: protocol.Submit, payload: bytes, sink: Sink) -> None:
        """Send `msg`, already encoded as `payload` (clients.wire.encode_submit)."""
        received = list(msg.resumed_token_ids or ()) if msg.streaming and not_resumable(msg) is None else None
        self._command("submit", _Call(msg.request_id, msg, payload, sink, received=received))

    def cancel(self, request_id: str) -> None:
        self._command("cancel", request_id)

    def close(self) -> None:
        if not self._closed.is_set():
            self._command("close", None)
            self.join(timeout=5)

    def _command(self, name: str, arg: object) -> None:
        if self._closed.is_set():
            raise RuntimeError("the client is closed")
        self._commands.put((name, arg))
        if not self._waking:
            self._waking = True
            os.write(self._wake_w, b"\0")

    # -- the I/O thread ---------------------------------------------------------------------

    def run(self) -> None:
        self._open_next()
        next_tick = time.monotonic() + self.heartbeat_interval_s
        try:
            while True:
                timeout_ms = int(max(0.0, next_tick - time.monotonic()) * 1000)
                events = dict(self._poller.poll(timeout_ms))
                if self._wake_r in events and not self._run_commands():
                    return
                if self._sock in events:
                    self._receive()
                if self._monitor in events and self._disconnected():
                    self._failover("its connection closed")
                if time.monotonic() >= next_tick:
                    self._tick()
                    # Until a gateway answers, its connect timeout is watched more closely.
                    wait = self.heartbeat_interval_s if self._ready else self.connect_timeout_s / 4
                    next_tick = time.monotonic() + min(self.heartbeat_interval_s, wait)
        finally:
            self._closed.set()
            for call in self._calls.values():
                call.sink.on_error(RequestError("closed", "the client was closed", call.request_id))
            self._calls.clear()
            self._close_socket()
            self._ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _run_commands(self) -> bool:
        while True:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                break
        self._waking = False  # before taking them: a command put after this writes a new byte
        while True:
            try:
                name, arg = self._commands.get_nowait()
            except queue.Empty:
                return True
            if name == "close":
                return False
            assert self._sock is not None
            if name == "submit":
                assert isinstance(arg, _Call)
                if arg.request_id in self._calls:
                    arg.sink.on_error(
                        RequestError("invalid_request", "request_id is already in flight", arg.request_id)
                    )
                    continue
                if self._unreachable():
                    arg.sink.on_error(self._unavailable(arg.request_id))
                    continue
                self._calls[arg.request_id] = arg
                self._send(arg.payload)
            elif name == "cancel":
                assert isinstance(arg, str)
                if arg in self._calls:
                    self._send(protocol.encode(protocol.Cancel(request_id=arg)))

    def _receive(self) -> None:
        assert self._sock is not None
        for _ in socket_turn():
            try:
                payload = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = protocol.decode(payload)
            except protocol.ProtocolError as e:
                log.error("gateway %s sent a bad message: %s", self.gateway, e)
                continue
            self._last_seen = time.monotonic()
            if isinstance(msg, protocol.ResultBatch):
                for response in msg.all_responses():  # the streamed steps come in columns
                    call = self._calls.get(response.request_id)
                    if call is None:
                        continue
                    call.started = True
                    if response.error_msg is not None:
                        del self._calls[response.request_id]
                        call.sink.on_error(RequestError("worker", response.error_msg, call.request_id))
                        continue
                    if response.is_final:
                        del self._calls[response.request_id]
                    elif call.received is not None and response.result is not None:
                        call.received += response.result.output_token_ids[0]
                    call.sink.on_response(response)
            elif isinstance(msg, protocol.ErrorReply):
                call = self._calls.pop(msg.request_id, None) if msg.request_id else None
                if call is not None:
                    call.sink.on_error(RequestError(str(msg.code), msg.message, msg.request_id))
                else:
                    log.warning("gateway %s: %s: %s", self.gateway, msg.code, msg.message)
            elif isinstance(msg, protocol.Ready):
                self._ready = True
                self._failed_opens = 0
                self._gateway_interval_s = msg.heartbeat_interval_s

    def _tick(self) -> None:
        assert self._sock is not None
        now = time.monotonic()
        limit = self.missed_heartbeats * self._gateway_interval_s if self._ready else self.connect_timeout_s
        silent = now - (self._last_seen if self._ready else self._opened)
        if silent > limit:
            self._failed_opens += not self._ready
            if self._unreachable():
                for request_id, call in list(self._calls.items()):
                    del self._calls[request_id]
                    call.sink.on_error(self._unavailable(request_id))
            self._failover(f"no answer for {silent:.1f} s")
        else:
            self._send(protocol.encode(protocol.Heartbeat(sender_id=self.client_id)))

    def _send(self, payload: bytes) -> None:
        """Send, or drop where the gateway refused our CURVE handshake: the DEALER then has
        no pipe and a send would block. The calls are kept: the heartbeat timeout fails
        over and resends them (or fails them). Without CURVE, connect makes the pipe at
        once and the send never blocks."""
        assert self._sock is not None
        with contextlib.suppress(zmq.Again):
            self._sock.send(payload, zmq.NOBLOCK)

    def _unreachable(self) -> bool:
        attempts = self.connect_attempts
        return attempts is not None and self._failed_opens >= attempts * len(self.gateways)

    def _unavailable(self, request_id: str) -> GatewayUnavailableError:
        tried = ", ".join(self.gateways)
        return GatewayUnavailableError(
            "unavailable",
            f"no gateway answered at {tried} ({self.connect_attempts} attempts each, {self.connect_timeout_s:g} s "
            "apiece): start one with `tokenwire gateway` (or `tokenwire up`), or point --gateway at a running one",
            request_id,
        )

    def _disconnected(self) -> bool:
        """Whether the connection of a gateway that had answered closed."""
        assert self._monitor is not None
        closed = False
        with contextlib.suppress(zmq.Again):
            while True:
                recv_monitor_message(self._monitor, zmq.NOBLOCK)
                closed = self._ready
        return closed

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(0)
        if self._monitor is not None:
            self._monitor.close(0)

    def _open_next(self) -> None:
        self._close_socket()
        self._index = (self._index + 1) % len(self.gateways)
        self.gateway = self.gateways[self._index]
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if self.curve is not None:
            connect_as_client(sock, self.curve.keypair, self.curve.server_public)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.gateway)
        self._sock = sock
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._ready = False
        self._opened = time.monotonic()
        self._send(
            protocol.encode(
                protocol.Hello(sender_id=self.client_id, role="client", heartbeat_interval_s=self.heartbeat_interval_s,
                               api_key=self.api_key)
            )
        )

    def _failover(self, why: str) -> None:
        lost, was_ready = self.gateway, self._ready
        self._open_next()
        if was_ready:  # a gateway that never answered is reported once, by _unavailable
            log.warning("gateway %s lost (%s); now using %s", lost, why, self.gateway)
        assert self._sock is not None
        for request_id, call in list(self._calls.items()):
            if call.started and call.received is None:
                del self._calls[request_id]
                call.sink.on_error(GatewayLostError(
                    "unavailable", f"gateway {lost} was lost ({why}) after the request had started streaming; a "
                    f"request with {not_resumable(call.submit) or 'no streaming'} cannot be resumed", request_id))
                continue
            if call.started and call.received:
                call.payload = protocol.encode(call.submit.model_copy(update={"resumed_token_ids": call.received}))
                log.info("request %s resumes through %s after %d tokens", request_id, self.gateway,
                         len(call.received))  # fmt: skip
            self._send(call.payload)
