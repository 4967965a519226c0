"""The gateway: a ROUTER for clients, a DEALER per worker, one I/O thread.

It keeps only soft state (request -> client, request -> worker); losing it
loses nothing durable: workers abort its requests when its heartbeats stop, and
clients fail over to another gateway.

A request is its client's and that client's request id: two clients may choose
the same id. Toward workers each request has an id unique among the gateway's
requests in flight (its wire id): the client's, unless another request in flight
has it already.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import secrets
import socket
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

import protocol
from gateway.api_keys import ApiKeys, HelloKeys
from gateway.client_batch import ClientBatch
from gateway.client_pipes import ClientPipes
from gateway.disagg import pick_pair, splits, whole_request_workers
from gateway.discovery import Discovery
from gateway.key_limits import KeyLimiter
from gateway.migration import Ended, next_run, tracks_tokens
from gateway.prefix_router import PrefixRouter, RouterName
from gateway.tokenizer_store import PromptError, Tokenizers
from gateway.workers import WorkerLink, adapter_models, can_load, serves
from ops.curve import CurveConfig, CurveServer, connect_as_client, routing_id
from ops.drain import Drain
from ops.metrics import GatewayMetrics, outcome
from ops.sd_notify import Notifier
from protocol import ErrorCode, chat_tools
from protocol.api_keys import ApiKeyRecord
from protocol.chat_template import ChatTemplateError
from protocol.limits import socket_turn
from protocol.model_fit import context_overflow, token_outside_vocabulary
from protocol.text import OutputStream

log = logging.getLogger(__name__)

# Where in-process clients (the HTTP front, gateway/http_front.py) reach the ROUTER.
INPROC_ENDPOINT = "inproc://gateway-clients"
# Text prompts (or chats) up to this many characters are tokenized on the socket loop: a
# millisecond or so. Longer ones go to a pool, so that one client's burst of large prompts
# never delays the loop (heartbeats, every other stream) nor other clients' short prompts.
# The pool is first come, first served: large prompts wait behind each other, not beside.
INLINE_TEXT_CHARS = 2048
# At most half the cores: encoding releases the GIL but not the CPU, and the loop needs one.
_TOKENIZER_THREADS = max(1, min(2, (os.cpu_count() or 2) // 2))


def _text_chars(msg: protocol.Submit) -> int:
    if msg.messages:
        return sum(len(m.content) for m in msg.messages)
    return len(msg.prompt or "")


@dataclass(slots=True)
class GatewayConfig:
    bind: str  # e.g. tcp://127.0.0.1:5550
    redis_url: str
    gateway_id: str = ""  # default: gw-host-pid
    redis_prefix: str = protocol.DEFAULT_PREFIX
    heartbeat_interval_s: float = 1.0
    # A worker or client silent for this many of its heartbeat intervals is gone.
    missed_heartbeats: int = 3
    discovery_interval_s: float = 0.5
    max_inflight: int = 4096
    max_inflight_per_client: int = 1024
    # How long a request may wait for a worker to serve it before it fails.
    no_worker_timeout_s: float = 10.0
    # After SIGTERM: how long the requests in flight may still take; new ones are refused meanwhile.
    drain_timeout_s: float = 30.0
    # Model name -> SHA-256 (hex) of the tokenizer.json its workers must send; unpinned,
    # the first one received is the model's.
    tokenizer_sha256: dict[str, str] = field(default_factory=dict)
    # CURVE on: clients must authenticate (with an allowed key, or any key), and only workers
    # whose registry entry carries a pinned key are connected to; None: off (loopback only).
    curve: CurveConfig | None = None
    # The binds served open beyond this host under --insecure, one line each (/health shows them).
    insecure: list[str] = field(default_factory=list)
    # How requests find a worker (gateway/prefix_router.py): by the prompt blocks its KV cache
    # holds and its load ("prefix"), or by load alone ("least-loaded").
    router: RouterName = "prefix"
    overlap_weight: float = 4.0  # what a prompt block to compute costs against a block held by decoding
    # Messages a client may leave unread before it is cut off (gateway/client_pipes.py).
    client_send_limit: int = 10_000
    # How often one request may be moved to another worker when its worker is lost (gateway/migration.py).
    migration_limit: int = 3
    # The format chats' tool calls are read in (protocol/tool_calls.py PARSERS); None: the
    # one the model's chat template teaches.
    tool_parser: str | None = None


@dataclass(eq=False, slots=True)
class _Request:
    request_id: str  # the client's
    wire_id: str  # toward workers: unique among the requests in flight here
    client: bytes
    submit: protocol.Submit  # as the client sent it (token ids filled in)
    stream: OutputStream
    model: str | None  # fixed once routed, so a re-dispatch keeps the vocabulary
    created: float = field(default_factory=time.monotonic)
    worker: WorkerLink | None = None
    started: bool = False  # the client has received some of its output
    dispatches: int = 0
    # Where a continuation can carry it on (gateway/migration.py): every token workers sent for
    # it (after those its client resumed from); None: not kept, no continuation can.
    received: list[int] | None = None
    dropped: str = ""  # why its last worker dropped it, for the error if no other takes it
    dropped_at: float | None = None  # then: it waits for another worker from here
    cancelled: bool = False  # its client cancelled it: its worker's final ends it, and it is never moved
    api_key: ApiKeyRecord | None = None  # the client's, where its limits apply
    lease: str = ""  # its place in its key's limits
    # Disaggregated serving (gateway/disagg.py): the decode worker its prefill worker hands it to,
    # the transfer its continuation waits for there, and whether it was handed off (no move).
    decode_worker: str | None = None
    kv_transfer: str | None = None
    handed_off: bool = False
    # The submit as the client sent it and its payload as it came: what goes to a worker
    # (gateway._encode_submit) while `submit` is still that one.
    sent: tuple[protocol.Submit, dict[str, Any]] | None = None


@dataclass(slots=True)
class _Client:
    heartbeat_interval_s: float
    last_seen: float = field(default_factory=time.monotonic)
    requests: dict[str, _Request] = field(default_factory=dict)  # by the client's request id
    authorized: bool = False  # it gave an accepted API key (where one is needed)
    api_key: ApiKeyRecord | None = None  # that key's record, whose limits and usage apply


class Gateway:
    def __init__(self, config: GatewayConfig, api_keys: ApiKeys | None = None) -> None:
        self.config = config
        # API keys on: HTTP requests need one (the HTTP front checks), and with CURVE off so do
        # ZeroMQ clients, in their Hello.
        self.api_keys = api_keys
        self.client_keys = HelloKeys(api_keys) if api_keys is not None and config.curve is None else None
        self.bridge_key = self.client_keys.own_key if self.client_keys is not None else None
        self.limits = protocol.DEFAULT_LIMITS
        self.keys = protocol.Keys(config.redis_prefix)
        self.ctx = zmq.Context()
        self.frontend = self.ctx.socket(zmq.ROUTER)
        # The HTTP front's routing id toward this ROUTER: a secret, so no TCP peer can pass for it.
        self.bridge_identity = secrets.token_bytes(16)
        self.pipes = ClientPipes(self.frontend, config.client_send_limit, self.bridge_identity)
        self._unread: set[bytes] = set()  # clients whose queue filled, cut off after this turn
        self.frontend.setsockopt(zmq.RCVHWM, 0)
        self.frontend.setsockopt(zmq.LINGER, 0)
        self._curve: CurveServer | None = None
        if config.curve is not None:
            self._curve = CurveServer("gateway", config.curve.keypair, config.curve.allowed)
            self._curve.start(self.ctx)
            self._curve.serve(self.frontend)  # inproc peers (the HTTP front) have no handshake
        self._refused_workers: set[tuple[str, str | None]] = set()  # logged once each
        self.frontend.bind(config.bind)
        self.address = self.frontend.getsockopt_string(zmq.LAST_ENDPOINT)
        self.frontend.bind(INPROC_ENDPOINT)
        self.gateway_id = config.gateway_id or f"gw-{socket.gethostname()}-{os.getpid()}"
        self.tokenizers = Tokenizers(config.tokenizer_sha256)
        self.stop = threading.Event()
        self.drain = Drain(config.drain_timeout_s)
        self.discovery = Discovery(
            config.redis_url,
            self.keys,
            config.discovery_interval_s,
            stale_after_s=max(10.0, 5 * config.heartbeat_interval_s),
            stop=self.stop,
        )
        self.workers: dict[str, WorkerLink] = {}
        self.lost_at: dict[str, float] = {}  # worker id -> unix time it was declared lost
        self.clients: dict[bytes, _Client] = {}
        self.requests: dict[str, _Request] = {}  # by wire id
        # Wire ids of requests ended here and cancelled at their worker, whose end the
        # worker has not confirmed yet: still taken there, so not given to a new request.
        self.ending: dict[str, WorkerLink] = {}
        self._wire_ids = 0  # wire ids made here so far
        self.waiting: deque[_Request] = deque()  # accepted, no worker yet
        self.poller = zmq.Poller()
        self.poller.register(self.frontend, zmq.POLLIN)
        self._pool = ThreadPoolExecutor(_TOKENIZER_THREADS, thread_name_prefix="gateway-tokenize")
        self._tokenized: queue.SimpleQueue[tuple[_Request, Future[list[int]]]] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()  # the pool's wake-ups for the poll below
        os.set_blocking(self._wake_read, False)
        self.poller.register(self._wake_read, zmq.POLLIN)
        self._sockets: dict[zmq.Socket, WorkerLink] = {}
        # Each worker socket's disconnect events: a worker process that dies closes its connections
        # at once, so the gateway need not wait out the heartbeat bound (a lost host still does).
        self._monitors: dict[zmq.Socket, WorkerLink] = {}
        self._monitor_of: dict[WorkerLink, zmq.Socket] = {}
        self.notifier = Notifier(address="")  # the process's own under systemd (gateway/__main__.py)
        self.metrics = GatewayMetrics()
        self.router = PrefixRouter(self.gateway_id, self.metrics, config.router, config.overlap_weight)
        # An API key's limits and usage, for ZeroMQ clients and the HTTP front alike.
        self.key_limits: KeyLimiter | None = None
        if self.api_keys is not None:
            self.key_limits = KeyLimiter(config.redis_url, self.keys, self.metrics, self.gateway_id)
        self.metrics.watch(
            lambda: len(self.requests),
            lambda: len(self.waiting),
            self._count_workers,
            lambda: len(self.clients),
            lambda: self.discovery.connected,
        )

    def _flush_submits(self) -> None:
        """What this turn dispatched, to each worker in one message (protocol/submit_batch.py):
        a burst reaches the worker, and so its engine, together."""
        for link in self.workers.values():
            if link.pending:
                link.flush()

    def _count_workers(self, state: str) -> int:
        def state_of(w: WorkerLink) -> str:
            return "connecting" if not w.ready else "draining" if w.draining else "ready"

        return sum(state_of(w) == state for w in list(self.workers.values()))

    # -- main loop ---------------------------------------------------------------------

    def serve(self) -> None:
        """Run until `self.stop` is set."""
        self.discovery.start()
        if self.api_keys is not None:
            self.api_keys.start()
        if self.key_limits is not None:
            self.key_limits.start()
        log.info("gateway %s listening at %s", self.gateway_id, self.address)
        interval = self.config.heartbeat_interval_s
        next_tick = 0.0
        ready_sent = False
        try:
            while not self.stop.is_set():
                self.notifier.watchdog()
                if not ready_sent and self.discovery.connected:
                    ready_sent = True
                    self.notifier.ready(f"gateway {self.gateway_id} listening at {self.address}; Redis reached")
                events = dict(self.poller.poll(50))
                if self.frontend in events:
                    self._from_clients()
                    self._flush_submits()
                if self._wake_read in events:
                    self._from_pool()
                for sock in [s for s in events if s is not self.frontend and s != self._wake_read]:
                    link = self._sockets.get(sock)
                    if link is not None:
                        self._from_worker(link)
                    elif (link := self._monitors.get(sock)) is not None:
                        self._disconnected(link)
                self._apply_discovery()
                now = time.monotonic()
                if now >= next_tick:
                    self._tick(now)
                    next_tick = now + interval
                if self.waiting:
                    self._dispatch_waiting(now)
                self._flush_submits()
                if self._unread:
                    self._cut_off_unread()
                if self.drain.begin(len(self.requests), self.notifier):
                    self._start_drain()
                if self.drain.draining and self._drained():
                    break
        finally:
            self.notifier.stopping(f"gateway {self.gateway_id} stopping")
            self.stop.set()
            self._pool.shutdown(wait=True, cancel_futures=True)  # a running encoding writes to the pipe
            os.close(self._wake_read)
            os.close(self._wake_write)
            self.discovery.join(timeout=5)
            for link in list(self.workers.values()):
                self._monitor_of[link].close(0)
                link.socket.close(0)
            self.frontend.close(0)
            if self._curve is not None:
                self._curve.stop()
            if self.api_keys is not None:
                self.api_keys.stop()
            if self.key_limits is not None:
                self.key_limits.stop()
            self.ctx.term()

    # -- drain -------------------------------------------------------------------------------

    def request_drain(self) -> None:
        """From a signal handler: the first call drains, a second ends the rest at once."""
        self.drain.request()

    @property
    def draining(self) -> bool:
        return self.drain.draining

    def _start_drain(self) -> None:
        # Not yet at a worker: their clients can send them elsewhere at once.
        waiting, self.waiting = self.waiting, deque()
        for req in waiting:
            if self.requests.get(req.wire_id) is req:
                self._fail(req, ErrorCode.DRAINING, f"gateway draining: {self.gateway_id} is shutting down")

    def _drained(self) -> bool:
        if not self.requests:
            log.info("drained: every request finished")
            return True
        why = self.drain.cut()
        if why is None:
            return False
        for req in list(self.requests.values()):
            if req.worker is not None:
                self._cancel_at_worker(req, req.worker)
            self._fail(req, ErrorCode.DRAINING, f"gateway draining: {self.gateway_id} is shutting down ({why})")
        log.warning("drain ended by %s", why)
        return True

    # -- clients ---------------------------------------------------------------------------

    def _from_clients(self) -> None:
        for _ in socket_turn():
            try:
                frames = self.frontend.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                if frames and len(frames[0]) > 0:
                    self._reply(
                        frames[0],
                        protocol.ErrorReply(
                            code=ErrorCode.PROTOCOL,
                            message=f"a message is one frame (msgpack); got {len(frames) - 1} frames",
                        ),
                    )
                continue
            try:
                self._from_client(frames[0], frames[1])
            except Exception as e:  # a bug on one message must not stop the gateway
                log.exception("message from client %s failed", frames[0].hex())
                self._reply(
                    frames[0],
                    protocol.ErrorReply(code=ErrorCode.INTERNAL, message=f"the gateway failed on this message: {e}"),
                )

    def _from_client(self, client: bytes, payload: bytes) -> None:
        try:
            msg, fields = protocol.decode_with_payload(payload, self.limits)
        except protocol.ProtocolError as e:
            self.metrics.protocol_errors.inc()
            if e.request_id is not None:
                self.metrics.ended(None, f"error_{ErrorCode.PROTOCOL}")
            self._reply(client, protocol.ErrorReply(code=ErrorCode.PROTOCOL, message=str(e), request_id=e.request_id))
            return
        state = self.clients.get(client)
        if state is None:
            state = self.clients[client] = _Client(self.config.heartbeat_interval_s)
        state.last_seen = time.monotonic()
        if not state.authorized and self.client_keys is not None and not isinstance(msg, protocol.Heartbeat):
            refusal = self.client_keys.refusal(msg)
            if refusal is not None:
                log.warning("client %s refused: %s", client.hex(), refusal.message)
                self._reply(client, refusal)
                return
            state.authorized = True
            state.api_key = self.client_keys.record(msg) if isinstance(msg, protocol.Hello) else None
        if isinstance(msg, protocol.Submit):
            self._submit(client, state, msg, fields)
        elif isinstance(msg, protocol.Cancel):
            self._cancel(state, msg.request_id)
        elif isinstance(msg, protocol.Hello):
            state.heartbeat_interval_s = msg.heartbeat_interval_s
            models = sorted({m for w in self.workers.values() if w.ready for m in w.models})
            adapters = sorted({a for w in self.workers.values() if w.ready for a in w.lora_adapters})
            loadable = sorted({a for w in self.workers.values() if w.ready for a in w.lora_loadable} - set(adapters))
            self._reply(
                client,
                protocol.Ready(
                    sender_id=self.gateway_id,
                    role="gateway",
                    heartbeat_interval_s=self.config.heartbeat_interval_s,
                    models=models,
                    lora_adapters=adapters,
                    lora_loadable=loadable,
                ),
            )
        elif isinstance(msg, protocol.Heartbeat):
            pass
        else:
            self._reply(
                client,
                protocol.ErrorReply(
                    code=ErrorCode.PROTOCOL,
                    message=f"a gateway does not accept {msg.kind} messages from clients",
                ),
            )

    def _submit(self, client: bytes, state: _Client, msg: protocol.Submit, fields: dict[str, Any]) -> None:
        """`fields`: `msg`'s payload as the client sent it."""
        sent = msg

        def refuse(code: ErrorCode, text: str) -> None:
            self.metrics.ended(None, f"error_{code}")
            self._reply(client, protocol.ErrorReply(code=code, message=text, request_id=msg.request_id))

        if self.draining:
            return refuse(ErrorCode.DRAINING, f"gateway draining: {self.gateway_id} takes no new requests")
        if msg.request_id in state.requests:
            return refuse(ErrorCode.INVALID_REQUEST, f"request_id {msg.request_id!r} is already in flight")
        if len(state.requests) >= self.config.max_inflight_per_client:
            return refuse(
                ErrorCode.OVERLOADED,
                f"busy: this client has {len(state.requests)} requests in "
                f"flight (limit {self.config.max_inflight_per_client}); retry when some finish",
            )
        if len(self.requests) >= self.config.max_inflight:
            return refuse(
                ErrorCode.OVERLOADED,
                f"busy: the gateway has {len(self.requests)} requests in "
                f"flight (limit {self.config.max_inflight}); retry later or use another gateway",
            )
        ready = [w for w in self.workers.values() if w.ready]
        model, lora = msg.model, msg.lora
        if model is not None and lora is None and ready and not any(model in w.models for w in ready):
            # As over HTTP (and in vLLM), `model` may name a LoRA adapter: run it under that adapter.
            base = adapter_models(ready).get(model)
            if base is not None:
                msg = msg.model_copy(update={"model": base, "lora_config": protocol.LoraConfig(name=model)})
                model, lora = base, model
        if model is not None and ready and not any(model in w.models for w in ready):
            served = sorted({m for w in ready for m in w.models})
            return refuse(ErrorCode.UNKNOWN_MODEL, f"no worker serves model {model!r}; served: {served}")
        if lora is not None and ready and not any(serves(w, model, lora) or can_load(w, model, lora) for w in ready):
            held = sorted({a for w in ready if serves(w, model, None) for a in w.lora_adapters})
            loadable = sorted({a for w in ready if serves(w, model, None) for a in w.lora_loadable} - set(held))
            return refuse(ErrorCode.UNKNOWN_MODEL, f"unknown LoRA adapter {lora!r}: no worker "
                          f"{'' if model is None else f'of model {model!r} '}holds it or can load it; "
                          f"held: {held}; loadable: {loadable}")  # fmt: skip
        if model is None and msg.input_token_ids is None:
            # Text is tokenized for one model: the one most ready workers serve. With none
            # ready yet, the first worker to take the request settles it.
            names = [m for w in ready if serves(w, None, lora) or (lora is not None and can_load(w, None, lora))
                     for m in w.models[:1]]  # fmt: skip
            model = max(set(names), key=names.count) if names else None
        if msg.tools:
            try:
                msg = chat_tools.with_guide(msg)
            except ValueError as e:
                return refuse(ErrorCode.INVALID_REQUEST, str(e))
        lease = ""
        if state.api_key is not None and self.key_limits is not None:
            lease = uuid.uuid4().hex
            over = self.key_limits.admit(state.api_key, lease)
            if over is not None:
                return refuse(ErrorCode.RATE_LIMITED, over.message)
        # Its tokenizer comes with the worker it is dispatched to.
        stream = OutputStream(None, msg.stop or [], msg.num_return_sequences, msg.sampling_config.beam_width > 1)
        req = _Request(msg.request_id, self._wire_id(msg.request_id), client, msg, stream, model,
                       api_key=state.api_key, lease=lease, sent=(sent, fields))  # fmt: skip
        if tracks_tokens(msg):
            req.received = list(msg.resumed_token_ids or ())
        self.requests[req.wire_id] = req
        self.metrics.accepted(req)
        state.requests[req.request_id] = req
        self._dispatch(req)

    def _wire_id(self, request_id: str) -> str:
        """The client's request id if no request in flight has it as its wire id, else a new one."""
        wire_id = request_id
        while wire_id in self.requests or wire_id in self.ending:
            self._wire_ids += 1
            wire_id = f"{request_id[:200]}~{self._wire_ids}"
        return wire_id

    def _cancel(self, state: _Client, request_id: str) -> None:
        req = state.requests.get(request_id)
        if req is None:
            return  # finished already: nothing to do
        self.metrics.client_cancelled(req, "cancel")
        req.cancelled = True
        if req.worker is not None:
            req.worker.send(protocol.encode(protocol.Cancel(request_id=req.wire_id)))
        else:  # still waiting for a worker: end it here
            self._finish_with_result(req, protocol.FinishReason.CANCELLED)

    def _reply(self, client: bytes, msg: protocol.Message) -> None:
        self._send(client, protocol.encode(msg, self.limits))

    def _send(self, client: bytes, payload: bytes) -> None:
        if not self.pipes.send(client, payload):
            self._unread.add(client)

    def _cut_off_unread(self) -> None:
        """Cut off the clients whose queues filled: their requests cancelled, an error each
        owed to them (gateway/client_pipes.py)."""
        for client in self._unread:
            state = self.clients.get(client)
            if state is None or self.pipes.owing(client):
                continue
            why = (f"cut off: this client left {self.pipes.limit} of the gateway's messages unread "
                   "(the gateway's --client-send-limit); its requests were cancelled")  # fmt: skip
            log.warning("client %s %s (%d requests)", client.hex(), why, len(state.requests))
            owed = [protocol.ErrorReply(code=ErrorCode.OVERLOADED, message=why, request_id=request_id)
                    for request_id in state.requests] or [protocol.ErrorReply(code=ErrorCode.OVERLOADED, message=why)]
            self._client_gone(client, state, "unread")
            self.pipes.owe(client, [protocol.encode(m, self.limits) for m in owed])
        self._unread.clear()

    # -- routing -----------------------------------------------------------------------------

    def _route(self, req: _Request) -> WorkerLink | None:
        """The worker for a request: a prefill worker where it is split (gateway/disagg.py)."""
        workers = list(self.workers.values())
        new = not req.dispatches
        pair = pick_pair(self.router, workers, req.model, req.submit) if new and splits(req.submit) else None
        req.decode_worker = None if pair is None else pair[1].worker_id
        if pair is not None:
            return pair[0]
        return self.router.pick(whole_request_workers(workers) if new else workers, req.model, req.submit)

    def _dispatch(self, req: _Request, to: WorkerLink | None = None) -> None:
        link = to or self._route(req)
        if link is None:
            self.waiting.append(req)
            return
        req.model = req.model or (link.models[0] if link.models else None)
        if req.submit.input_token_ids is None:  # text, or a chat: token ids first
            if _text_chars(req.submit) > INLINE_TEXT_CHARS:
                return self._tokenize_in_pool(req, link.max_seq_len)
            try:
                self._set_prompt_ids(req, self._prompt_ids(req, link.max_seq_len))
            except (PromptError, ChatTemplateError) as e:
                return self._fail(req, ErrorCode.INVALID_REQUEST, str(e))
            link = self._route(req) or link  # now by its tokens
        problem = self._check_fits(req.submit, link)
        if problem:
            self._fail(req, ErrorCode.INVALID_REQUEST, problem)
            return
        tokenizer = self.tokenizers.get(req.model) if req.model is not None else None
        req.stream.tokenizer = req.stream.tokenizer or tokenizer
        if not req.dispatches and req.submit.resumed_token_ids:
            req.stream.resume(req.submit.resumed_token_ids)  # a client's continuation: their text was sent
        req.worker = link
        if not req.dispatches:
            self.metrics.dispatched(time.monotonic() - req.created, req.model)
        req.dispatches += 1
        link.requests.add(req.wire_id)
        link.sent_since_load += 1
        # A client's own client_request_id is not passed on: the worker names the request by it.
        named = None if req.wire_id == req.request_id else req.request_id
        update: dict[str, object] = {"request_id": req.wire_id, "client_request_id": named, "model": req.model,
                                     "stop": None, "tools": None, "tool_choice": None}
        decode = self.workers.get(req.decode_worker) if req.decode_worker is not None else None
        if decode is not None and decode.info.kv_address is not None and link is not decode:
            # Named by this gateway too (decode workers take transfers from every gateway), in a bounded length.
            transfer = hashlib.blake2b(f"{self.gateway_id}\0{req.wire_id}".encode(), digest_size=16).hexdigest()
            update["kv_handoff"] = protocol.KvHandoff(transfer_id=transfer, kv_address=decode.info.kv_address)
        update["kv_transfer_id"], req.kv_transfer = req.kv_transfer, None
        link.submit(self._encode_submit(req, update))

    def _encode_submit(self, req: _Request, update: dict[str, object]) -> bytes:
        """The request's Submit with `update`, toward a worker: the client's payload with
        those fields changed while the submit is still the one the client sent (no second
        encoding of what was just decoded), else the submit encoded anew."""
        if req.sent is None or req.sent[0] is not req.submit:
            return protocol.encode(req.submit.model_copy(update=update), self.limits)
        payload = {k: v for k, v in req.sent[1].items() if k not in update}
        for k, v in update.items():
            if v is not None:  # None is each of these fields' default: left out, as encode does
                payload[k] = v.model_dump(exclude_defaults=True) if isinstance(v, protocol.WireModel) else v
        return protocol.encode_payload(protocol.Submit.kind, payload, self.limits, request_id=req.wire_id)

    def _prompt_ids(self, req: _Request, max_seq_len: int | None) -> list[int]:
        messages = req.submit.messages
        if not messages:
            return self.tokenizers.prompt_ids(req.model, req.submit.prompt, None, max_seq_len)
        try:
            chat = chat_tools.template_messages(messages)
        except ValueError as e:
            raise PromptError(str(e)) from None
        return self.tokenizers.prompt_ids(req.model, None, chat, max_seq_len, chat_tools.template_extra(req.submit))

    @staticmethod
    def _set_prompt_ids(req: _Request, ids: list[int]) -> None:
        req.submit = req.submit.model_copy(update={"prompt": None, "messages": None, "input_token_ids": ids})

    # -- tokenization of long prompts, off the socket loop -----------------------------------

    def _tokenize_in_pool(self, req: _Request, max_seq_len: int | None) -> None:
        """Tokenize `req`'s long text on the pool; `_from_pool` dispatches it when done.
        Meanwhile it is at no worker, so a cancel or its client going away ends it here."""

        def done(future: Future[list[int]]) -> None:
            self._tokenized.put((req, future))
            os.write(self._wake_write, b"\0")  # a byte per result: the loop wakes, whatever it polls

        self._pool.submit(self._prompt_ids, req, max_seq_len).add_done_callback(done)

    def _from_pool(self) -> None:
        os.read(self._wake_read, 4096)
        while True:
            try:
                req, future = self._tokenized.get_nowait()
            except queue.Empty:
                return
            if self.requests.get(req.wire_id) is not req:
                continue  # cancelled, or its client went away, meanwhile
            try:
                self._set_prompt_ids(req, future.result())
            except (PromptError, ChatTemplateError) as e:
                self._fail(req, ErrorCode.INVALID_REQUEST, str(e))
                continue
            except Exception as e:  # a bug on one prompt must not stop the gateway
                log.exception("request %s: tokenizing failed", req.request_id)
                self._fail(req, ErrorCode.INTERNAL, f"the gateway failed to tokenize the prompt: {e}")
                continue
            self._dispatch(req)  # to the least loaded worker now: the one chosen before may be gone

    @staticmethod
    def _check_fits(msg: protocol.Submit, link: WorkerLink) -> str | None:
        ids = msg.input_token_ids or []
        if link.vocab_size is not None:
            table = msg.prompt_tuning_config
            problem = token_outside_vocabulary(ids, link.vocab_size, 0 if table is None else table.rows)
            if problem is not None:
                return problem
        if link.max_seq_len is not None:
            # An embedding generates nothing: its prompt alone must fit.
            generated = 0 if msg.embedding_config is not None else msg.max_tokens
            return context_overflow(len(ids), generated, link.max_seq_len)
        return None

    def _dispatch_waiting(self, now: float) -> None:
        waiting, self.waiting = self.waiting, deque()
        for req in waiting:
            if self.requests.get(req.wire_id) is not req:
                continue  # cancelled or its client went away meanwhile
            if now - (req.dropped_at or req.created) > self.config.no_worker_timeout_s:
                lora = req.submit.lora
                adapter = "" if lora is None else f" holding (or able to load) LoRA adapter {lora!r}"
                self._fail(
                    req,
                    ErrorCode.UNAVAILABLE,
                    f"no worker for model {req.model or '(any)'}{adapter} became available within "
                    f"{self.config.no_worker_timeout_s:g} s{req.dropped}",
                )
            elif any(w.ready for w in self.workers.values()):
                self._dispatch(req)
            else:
                self.waiting.append(req)

    # -- workers -------------------------------------------------------------------------------

    def _apply_discovery(self) -> None:
        try:
            snapshot = self.discovery.snapshots.get_nowait()
        except queue.Empty:
            return
        for worker_id, (info, heartbeat_time) in snapshot.items():
            link = self.workers.get(worker_id)
            if link is not None and link.info.address == info.address:
                continue
            if heartbeat_time <= self.lost_at.get(worker_id, 0.0):
                continue  # the registry still shows a worker we lost; wait for a fresh heartbeat
            if not self._pinned(info):
                continue
            if link is not None:
                self._lose_worker(link, "it re-registered at a new address")
            self._connect(info)

    def _pinned(self, info: protocol.WorkerInfo) -> bool:
        """With CURVE on: whether the worker's registry entry carries a pinned key. A
        fake worker written into Redis has none, or another; it is refused and logged."""
        curve = self.config.curve
        if curve is None or (info.curve_public_key is not None and info.curve_public_key.encode() in curve.workers):
            return True
        if (info.worker_id, info.curve_public_key) not in self._refused_workers:
            self._refused_workers.add((info.worker_id, info.curve_public_key))
            why = "no CURVE key" if info.curve_public_key is None else f"CURVE key {info.curve_public_key}, not pinned"
            log.warning("refused worker %s at %s: its registry entry carries %s", info.worker_id, info.address, why)
        return False

    def _connect(self, info: protocol.WorkerInfo) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        # The worker knows this socket by a secret routing id (CURVE or not): a peer that takes
        # the gateway's name is refused and logged there, and cannot silently collide with this socket.
        sock.setsockopt(zmq.IDENTITY, routing_id(self.gateway_id))
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        if self.config.curve is not None and info.curve_public_key is not None:  # _pinned checked the key
            connect_as_client(sock, self.config.curve.keypair, info.curve_public_key.encode())
        sock.connect(info.address)
        link = WorkerLink(info, sock, limits=self.limits)
        self.workers[info.worker_id] = link
        self._sockets[sock] = link
        monitor = self._monitor_of[link] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._monitors[monitor] = link
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)
        sock.send(
            protocol.encode(
                protocol.Hello(
                    sender_id=self.gateway_id,
                    role="gateway",
                    heartbeat_interval_s=self.config.heartbeat_interval_s,
                )
            )
        )
        log.info("connecting to worker %s at %s", info.worker_id, info.address)

    def _from_worker(self, link: WorkerLink) -> None:
        for _ in socket_turn():
            try:
                payload = link.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if self.workers.get(link.worker_id) is not link:
                return  # lost meanwhile
            try:
                msg = protocol.decode(payload, self.limits)
            except protocol.ProtocolError as e:
                self.metrics.protocol_errors.inc()
                log.error("worker %s sent a bad message: %s", link.worker_id, e)
                continue
            link.last_seen = time.monotonic()
            if isinstance(msg, protocol.ResultBatch):
                link.update_load(msg.load)
                try:
                    self._results(link, msg)
                except Exception:  # a bug on one batch must not stop the gateway
                    log.exception("results from worker %s failed", link.worker_id)
            elif isinstance(msg, protocol.Heartbeat):
                link.update_load(msg.load)
            elif isinstance(msg, protocol.ErrorReply):
                self._worker_error(link, msg)
            elif isinstance(msg, protocol.HandedOff):
                self._handed_off(link, msg)
            elif isinstance(msg, protocol.KvEvents | protocol.KvSnapshot):
                self.router.kv_message(link, msg)
            elif isinstance(msg, protocol.LoraAdapters):
                link.lora_adapters, link.lora_loadable = frozenset(msg.adapters), frozenset(msg.loadable)
                log.info("worker %s holds LoRA adapters %s, can load %s", link.worker_id, sorted(msg.adapters),
                         sorted(msg.loadable))  # fmt: skip
            elif isinstance(msg, protocol.Drain):
                # It finishes what it has (results keep coming on this link) but takes nothing new.
                link.draining = True
                log.info("worker %s draining: no new requests go to it", link.worker_id)
            elif isinstance(msg, protocol.Ready):
                sender = f"worker {link.worker_id}"
                if msg.tokenizer_json is not None and not all(
                    self.tokenizers.add(model, msg.tokenizer_json, sender) for model in msg.models
                ):
                    self._lose_worker(link, "its tokenizer is not the one this gateway holds for its model")
                    return
                link.ready = True
                link.heartbeat_interval_s = msg.heartbeat_interval_s
                link.models = list(msg.models)
                link.lora_adapters, link.lora_loadable = frozenset(msg.lora_adapters), frozenset(msg.lora_loadable)
                link.vocab_size = msg.vocab_size
                link.max_seq_len = msg.max_seq_len
                link.update_load(msg.load)
                link.submit_batches = msg.submit_batches
                for model in msg.models:
                    self.tokenizers.add_chat(model, msg)
                log.info("worker %s ready: %s", link.worker_id, msg.models)

    def _results(self, link: WorkerLink, batch: protocol.ResultBatch) -> None:
        """Each client its share of a worker's batch, in one message: the streamed
        steps stay columns (with their text), the rest goes whole."""
        out: dict[bytes, ClientBatch] = {}
        tokens: list[tuple[object, int]] = []  # (request, new tokens sent), for the metrics
        ended: list[tuple[_Request, str]] = []

        def whole(req: _Request, response: protocol.Response, worker_final: bool) -> None:
            result = response.result
            if result is not None and result.is_final and req.submit.tools:
                self._read_calls(req, result)
            to = out.get(req.client) or out.setdefault(req.client, ClientBatch())
            if response.request_id != req.request_id:  # the worker's, by wire id
                response = response.model_copy(update={"request_id": req.request_id})
            to.add_response(response)
            tokens.append((req, 0 if result is None else sum(len(t) for t in result.output_token_ids)))
            if result is None or result.is_final:
                if not worker_final:  # a stop string ended it here: stop the worker too
                    self._cancel_at_worker(req, link)
                self._forget(req)
                ended.append((req, outcome(response)))

        requests = self.requests
        streamed = batch.streamed
        if streamed is not None:
            token_ids = streamed.token_ids
            end = 0
            for wire_id, n in zip(streamed.request_ids, streamed.counts, strict=True):
                start, end = end, end + n
                req = requests.get(wire_id)
                if req is None or req.worker is not link:
                    continue
                ids = token_ids[start:end]
                if req.received is not None:
                    req.received += ids
                step = req.stream.apply_tokens(ids)
                if step is None:
                    continue
                req.started = True
                if isinstance(step, protocol.Result):  # it needed a Result: does it still go in a column?
                    if step.is_sequence_final or req.stream.beam_search:
                        whole(req, protocol.Response(request_id=req.request_id, result=step), False)
                        continue
                    text = step.text[0] if step.text else ""
                else:
                    text = step
                to = out.get(req.client) or out.setdefault(req.client, ClientBatch())
                to.add_step(req.request_id, ids, text)
                tokens.append((req, n))
        for response in batch.responses:  # finals, errors, beams, log probs (older workers: every step)
            req = requests.get(response.request_id)
            if req is None or req.worker is not link:
                if response.is_final:
                    self._ended_at_worker(response.request_id, link)
                continue
            if response.result is None:
                whole(req, response, True)
                continue
            worker_final = response.result.is_final
            if req.received is not None:
                req.received += response.result.output_token_ids[0]
            if req.stream.apply(response.result) is None:
                continue
            req.started = True
            whole(req, response, worker_final)
        self.metrics.streams.tokens(tokens)  # before ended() forgets the streams' timings
        for req, how in ended:
            self.metrics.ended(req, how)
        for client, to in out.items():
            for message in to.messages(self.limits):
                self._send(client, message)

    def _read_calls(self, req: _Request, result: protocol.Result) -> None:
        use = chat_tools.tool_use(req.submit, self.tokenizers.chat_template(req.model), self.config.tool_parser)
        read = None if use is None else chat_tools.read_calls(use, req.stream.whole_text())
        if read is not None:
            content, result.tool_calls = read
            if not req.submit.streaming:  # streamed, the text is out already
                result.text = [content]

    def _worker_error(self, link: WorkerLink, msg: protocol.ErrorReply) -> None:
        req = self.requests.get(msg.request_id) if msg.request_id else None
        if req is None or req.worker is not link:
            if msg.request_id is not None:
                self._ended_at_worker(msg.request_id, link)
            log.warning("worker %s: %s error: %s", link.worker_id, msg.code, msg.message)
            return
        if msg.worker_ended or msg.code == ErrorCode.DRAINING:
            # The worker's reason, not the request's (a DRAINING refusal was sent before its Drain reached
            # us); it is going away either way, so nothing new goes to it.
            link.draining = True
            link.requests.discard(req.wire_id)
            req.worker = None
            self._move(req, link, msg.message)
            return
        self.metrics.ended(req, f"error_{msg.code}")
        self._reply(req.client, msg.model_copy(update={"request_id": req.request_id}))
        self._forget(req)

    def _handed_off(self, link: WorkerLink, msg: protocol.HandedOff) -> None:
        """A prefill worker sent the first token and the KV blocks: the rest is the decode
        worker's, as a continuation (any worker's, if that one is gone meanwhile)."""
        req = self.requests.get(msg.request_id)
        if req is None or req.worker is not link:
            return  # ended here meanwhile (a stop string), or its client went away
        link.requests.discard(req.wire_id)
        req.worker = None
        if req.cancelled:
            self._finish_with_result(req, protocol.FinishReason.CANCELLED)
            return
        decode = self.workers.get(req.decode_worker) if req.decode_worker is not None else None
        req.decode_worker = None
        req.handed_off = True
        req.submit = req.submit.model_copy(update={"resumed_token_ids": list(req.received or [])})
        if decode is None or not decode.ready or decode.draining:
            self._dispatch(req)
            return
        req.kv_transfer = msg.transfer_id if msg.num_blocks else None
        self._dispatch(req, to=decode)

    def _disconnected(self, link: WorkerLink) -> None:
        """Its connection closed: a worker that was ready is gone (a process that dies closes
        its connections at once); before that, ZeroMQ keeps trying and the heartbeat bound applies."""
        for _ in socket_turn():
            try:
                recv_monitor_message(self._monitor_of[link], zmq.NOBLOCK)
            except zmq.Again:
                return
            if link.ready and self.workers.get(link.worker_id) is link:
                while link.socket.poll(0) and self.workers.get(link.worker_id) is link:
                    self._from_worker(link)  # what it sent before it went: its last results, its errors
                if self.workers.get(link.worker_id) is link:
                    self._lose_worker(link, "its connection closed")
                return

    def _lose_worker(self, link: WorkerLink, why: str) -> None:
        log.warning("worker %s lost (%s): %d requests affected", link.worker_id, why, len(link.requests))
        self.workers.pop(link.worker_id, None)
        self.router.forget(link)
        self._sockets.pop(link.socket, None)
        self.poller.unregister(link.socket)
        monitor = self._monitor_of.pop(link)
        del self._monitors[monitor]
        self.poller.unregister(monitor)
        link.socket.disable_monitor()
        monitor.close(0)
        link.socket.close(0)
        self.lost_at[link.worker_id] = time.time()
        self.ending = {wire_id: w for wire_id, w in self.ending.items() if w is not link}
        for wire_id in list(link.requests):
            req = self.requests.get(wire_id)
            if req is None or req.worker is not link:
                continue
            req.worker = None
            self._move(req, link, f"it was lost: {why}")
        link.requests.clear()

    def _move(self, req: _Request, link: WorkerLink, why: str) -> None:
        """Carry a request on to another worker after `link` dropped it (gateway/migration.py)."""
        if req.cancelled:  # the worker went before it confirmed the cancel
            self._finish_with_result(req, protocol.FinishReason.CANCELLED)
            return
        received = req.received or []
        moves = req.dispatches - 1 - req.handed_off  # a hand-off to the decode worker is no move
        run = next_run(req.submit, req.started, received, moves, self.config.migration_limit)
        if isinstance(run, Ended):
            self.metrics.migrated(req, run.outcome)
            self._fail(req, ErrorCode.UNAVAILABLE, f"worker {link.worker_id} dropped this request after "
                       f"{req.stream.num_tokens} tokens ({why}); {run.why}")  # fmt: skip
            return
        how = "continued" if run.resumed_token_ids else "restarted"
        self.metrics.migrated(req, how)
        log.info("request %s %s on another worker (%d tokens received): worker %s dropped it (%s)",
                 req.request_id, how, len(received), link.worker_id, why)  # fmt: skip
        req.submit = run
        req.dropped = f" (worker {link.worker_id} dropped it after {req.stream.num_tokens} tokens: {why})"
        req.dropped_at = time.monotonic()
        self._dispatch(req)

    # -- bookkeeping ----------------------------------------------------------------------------

    def _fail(self, req: _Request, code: ErrorCode, text: str) -> None:
        self.metrics.ended(req, f"error_{code}")
        self._reply(req.client, protocol.ErrorReply(code=code, message=text, request_id=req.request_id))
        self._forget(req)

    def _finish_with_result(self, req: _Request, reason: protocol.FinishReason) -> None:
        n = req.submit.num_return_sequences
        responses = [
            protocol.Response(
                request_id=req.request_id,
                result=protocol.Result(
                    is_final=i == n - 1,
                    output_token_ids=[[]],
                    finish_reasons=[reason],
                    sequence_index=i,
                    is_sequence_final=True,
                ),
            )
            for i in range(n)
        ]
        self.metrics.ended(req, "cancelled")
        self._reply(req.client, protocol.ResultBatch(responses=responses))
        self._forget(req)

    def _cancel_at_worker(self, req: _Request, link: WorkerLink) -> None:
        """Cancel a request this gateway ends itself; its wire id stays taken until the worker's final."""
        link.send(protocol.encode(protocol.Cancel(request_id=req.wire_id)))
        self.ending[req.wire_id] = link

    def _ended_at_worker(self, wire_id: str, link: WorkerLink) -> None:
        if self.ending.get(wire_id) is link:
            del self.ending[wire_id]

    def _forget(self, req: _Request) -> None:
        if self.requests.get(req.wire_id) is req:
            del self.requests[req.wire_id]
            if req.worker is not None:
                req.worker.requests.discard(req.wire_id)
            if req.api_key is not None and self.key_limits is not None:
                prompt = len(req.submit.input_token_ids or [])
                self.key_limits.done(req.api_key, req.lease, prompt, req.stream.num_tokens)
        client = self.clients.get(req.client)
        if client is not None and client.requests.get(req.request_id) is req:
            del client.requests[req.request_id]

    def _tick(self, now: float) -> None:
        n = self.config.missed_heartbeats
        for link in list(self.workers.values()):
            silent = now - (link.last_seen if link.ready else link.connected_at)
            limit = n * (link.heartbeat_interval_s if link.ready else self.config.heartbeat_interval_s)
            if silent > limit:
                self._lose_worker(link, f"no heartbeat for {silent:.1f} s")
        for client, state in list(self.clients.items()):
            if now - state.last_seen > n * state.heartbeat_interval_s:
                self._client_gone(client, state, "gone")
        beat = protocol.encode(protocol.Heartbeat(sender_id=self.gateway_id))
        for link in self.workers.values():
            link.send(beat)
        for client in self.clients:
            self._send(client, beat)
        self.pipes.pay()

    def _client_gone(self, client: bytes, state: _Client, why: str) -> None:
        if state.requests and why == "gone":
            log.info("client %s silent: cancelling its %d requests", client.hex(), len(state.requests))
        for req in list(state.requests.values()):
            self.metrics.client_cancelled(req, why)
            if req.worker is not None:
                self._cancel_at_worker(req, req.worker)
            self.metrics.ended(req, None)
            self._forget(req)
        del self.clients[client]
