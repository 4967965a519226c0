"""The worker service: one executor (in its engine process) behind a ZeroMQ
ROUTER that gateways connect to.

Threads of the worker process, none of which shares a GIL with the executor:
- the I/O thread (`serve`) owns the ROUTER: submits, cancels, hello and
  heartbeats in; result batches, heartbeats and KV cache events out;
- the result pump waits on the engine, coalesces each of its messages into one
  result batch per gateway and hands them to the I/O thread over an inproc socket;
- the Redis thread (redis_link.WorkerRedis).
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import zmq

import protocol
from ops.curve import CurveConfig, CurveServer, IdentityKeys, identity_name
from ops.drain import Drain
from ops.metrics import WorkerMetrics, outcome
from ops.sd_notify import Notifier
from protocol import ErrorCode
from protocol.limits import socket_turn
from protocol.packed import Unpacking
from worker.executor import types as ex
from worker.executor.engine_core import StepOutput
from worker.service.active import Active, ActiveTable
from worker.service.admission import too_large
from worker.service.convert import WireBatch, to_request
from worker.service.ended_log import EndedLog
from worker.service.engine import EngineFailed, EngineProcess, LoraReply
from worker.service.engine_kv import KvExported, KvImported, ends_for_hand_off
from worker.service.kv_publisher import KvPublisher
from worker.service.kv_sender import KvSender
from worker.service.kv_transfer import KvPushers, KvTransferError, from_frames, ipc_of
from worker.service.kv_transport import KvTransport, Mode
from worker.service.lora_dir import LoraDir, PendingLoads, Taken
from worker.service.redis_link import WorkerRedis

log = logging.getLogger(__name__)

_PUMP_ENDPOINT = "inproc://worker-results"
# How long a decode worker holds a continuation for the KV blocks it names before computing
# its prompt itself: the blocks and the gateway's continuation leave the prefill worker's
# host at the same time, so they arrive close together unless the prefill worker died.
KV_WAIT_S = 2.0
_KV_ARRIVED_KEPT = 10_000  # transfer ids remembered, for continuations that come after their blocks


@dataclass(slots=True)
class ServiceConfig:
    bind: str  # e.g. tcp://127.0.0.1:5600
    redis_url: str
    model_name: str
    worker_id: str = ""  # default: host:port
    advertise: str = ""  # address gateways connect to; default: the bind address
    redis_prefix: str = protocol.DEFAULT_PREFIX
    heartbeat_interval_s: float = 1.0
    # A gateway silent for this many of its heartbeat intervals is gone: its requests are aborted.
    missed_heartbeats: int = 3
    cancel_poll_interval_s: float = 0.25
    stats_stream_maxlen: int = 1000
    request_stats_ttl_s: float = 3600.0
    device: str | None = None
    # After SIGTERM: how long in-flight requests may still take before they end with a
    # "worker draining" error.
    drain_timeout_s: float = 60.0
    # CURVE on: gateways must authenticate with an allowed key; None: off (loopback only).
    curve: CurveConfig | None = None
    # LoRA adapters loaded when a request names one: the subdirectories of this directory (lora_dir.py).
    lora_dir: str | None = None
    # Disaggregated serving (protocol/kv_transfer.py): which requests gateways send this worker,
    # and where it takes KV blocks from prefill workers (None: it takes none).
    role: Literal["prefill", "decode", "both"] = "both"
    kv_bind: str | None = None
    kv_transfer: Mode = "auto"  # how this worker sends KV blocks (worker/service/kv_transport.py)


@dataclass(slots=True)
class _Gateway:
    heartbeat_interval_s: float
    last_seen: float = field(default_factory=time.monotonic)


class ListenError(RuntimeError):
    """A socket the worker cannot listen on; the text is the one line to show."""


@dataclass(slots=True)
class Listener:
    """The worker's listening sockets, bound before its model loads (minutes, on a GPU)
    so that a port in use fails start-up at once, and stays the worker's: the ROUTER
    gateways connect to (a CURVE server where configured) and /metrics."""

    ctx: zmq.Context
    router: zmq.Socket
    curve: CurveServer | None
    metrics: WorkerMetrics

    @classmethod
    def open(cls, bind: str, curve: CurveConfig | None, metrics_host: str = "", metrics_port: int = 0) -> Listener:
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.SNDHWM, 0)  # bounded by the executor's admitted work
        router.setsockopt(zmq.RCVHWM, 0)
        router.setsockopt(zmq.LINGER, 0)
        # No handover: a second connection under a live gateway's id would get that gateway's
        # results. libzmq keeps the first connection and drops what the second sends.
        server = None
        if curve is not None:
            server = CurveServer("worker", curve.keypair, curve.allowed)
            server.start(ctx)
            server.serve(router)
        listener = cls(ctx, router, server, WorkerMetrics())
        try:
            router.bind(bind)
        except zmq.ZMQError as e:
            listener.close()
            raise ListenError(
                f"cannot listen at {bind}: {e.strerror} (is another worker running there? see --bind)"
            ) from None
        if metrics_port:
            try:
                listener.metrics.serve(metrics_host, metrics_port)
            except OSError as e:
                listener.close()
                raise ListenError(f"cannot serve /metrics at {metrics_host}:{metrics_port}: {e.strerror}") from None
        return listener

    def close(self) -> None:
        """Only where the service never ran: WorkerService.serve closes them itself."""
        self.router.close(0)
        if self.curve is not None:
            self.curve.stop()
        self.ctx.term()


class WorkerService:
    def __init__(self, engine: EngineProcess, config: ServiceConfig, notifier: Notifier | None = None,
                 listener: Listener | None = None) -> None:  # fmt: skip
        self.engine = engine
        self.config = config
        # First: a --kv-transfer this worker cannot serve stops it before anything opens.
        self._kv_transport = KvTransport(config.kv_transfer, bool(engine.info.cuda_devices))
        self.notifier = notifier or Notifier(address="")
        self.drain = Drain(config.drain_timeout_s)
        self.limits = protocol.DEFAULT_LIMITS
        self.keys = protocol.Keys(config.redis_prefix)
        listener = listener or Listener.open(config.bind, config.curve)
        self.ctx, self.router, self._curve = listener.ctx, listener.router, listener.curve
        self.metrics = listener.metrics
        # A gateway's name belongs to the credential that first used it (its CURVE key, or without
        # CURVE its secret routing id): a peer that uses the name with another is refused (and
        # logged) until the gateway is declared gone.
        self._identity_keys = IdentityKeys("worker", curve=config.curve is not None)
        address = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.address = config.advertise or address.replace("0.0.0.0", socket.gethostname())
        port = address.rsplit(":", 1)[-1]
        self.worker_id = config.worker_id or f"{socket.gethostname()}:{port}"
        self.sender_id = self.worker_id
        self.kv = KvPublisher(self.sender_id, engine.info.block_size)
        self.table = ActiveTable()
        self.ended_log = EndedLog()  # the result pump's
        self.gateways: dict[bytes, _Gateway] = {}
        # Submits of the current socket turn by (gateway, request id), with the client's id for the
        # request (see Active.name), enqueued together at the turn's end.
        self._taken: dict[tuple[bytes, str], tuple[ex.Request, str]] = {}
        self.stop = threading.Event()
        # The Redis thread outlives the pump: it writes the stats of the last requests to finish.
        self._redis_stop = threading.Event()
        self.engine_failure = ""  # why the engine process ended under us, if it did
        # LoRA adapters: those held (as of the engine's last answer), the loads and unloads asked
        # by token -> (peer, its request id), and the engine's answers, from the pump to this thread.
        self.lora_adapters: list[str] = list(engine.info.lora_adapters)
        self._lora_asks: dict[int, tuple[bytes, str]] = {}
        self._lora_tokens = itertools.count(1)
        self._lora_replies: collections.deque[LoraReply] = collections.deque()
        self._lora_dir = LoraDir(config.lora_dir)
        self._lora_pending = PendingLoads()  # requests waiting for an adapter loaded on their demand
        self.lora_loadable = [n for n in self._lora_dir.names() if n not in self.lora_adapters]
        info = protocol.WorkerInfo(
            worker_id=self.worker_id,
            address=self.address,
            models=[config.model_name],
            host=socket.gethostname(),
            pid=os.getpid(),
            device=config.device,
            started_at=time.time(),
            max_batch_size=engine.info.max_batch_size,
            curve_public_key=config.curve.keypair.public.decode() if config.curve is not None else None,
            lora_adapters=self.lora_adapters,
            lora_loadable=self.lora_loadable,
            role=config.role,
        )
        self.redis = WorkerRedis(
            config.redis_url,
            self.keys,
            info,
            engine,
            self.table,
            self.load,
            heartbeat_interval_s=config.heartbeat_interval_s,
            cancel_poll_interval_s=config.cancel_poll_interval_s,
            stats_stream_maxlen=config.stats_stream_maxlen,
            request_stats_ttl_s=config.request_stats_ttl_s,
            stop=self._redis_stop,
        )
        self._pump_out = self.ctx.socket(zmq.PAIR)
        self._pump_out.bind(_PUMP_ENDPOINT)
        self._pump = threading.Thread(target=self._pump_results, name="worker-pump", daemon=True)
        # Disaggregated serving: KV blocks in (the I/O thread) and out (the pump).
        self._kv_in: zmq.Socket | None = None
        if config.kv_bind is not None:
            self._kv_in = self.ctx.socket(zmq.ROUTER)
            self._kv_in.setsockopt(zmq.LINGER, 0)
            self._kv_in.bind(config.kv_bind)
            kv_address = self._kv_in.getsockopt_string(zmq.LAST_ENDPOINT).replace("0.0.0.0", socket.gethostname())
            self.redis.info = self.redis.info.model_copy(update={"kv_address": kv_address})
        self._kv_out = KvSender(KvPushers(self.ctx, self.limits), engine, self._kv_transport, self.metrics)
        # CUDA IPC transfers in: who shared each buffer (I/O thread), and the engine's answers
        # for them (pump to I/O thread).
        self._kv_sources: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._kv_answers: collections.deque[tuple[str, bool]] = collections.deque()
        self._handoffs: dict[tuple[bytes, str], protocol.KvHandoff] = {}  # of this turn's submits
        self._handing_off: dict[int, protocol.KvHandoff] = {}  # by executor id, until the first token is out
        self._kv_arrived: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._awaiting_kv: dict[str, tuple[float, tuple[bytes, str], tuple[ex.Request, str]]] = {}
        self.metrics.watch(self.load, lambda: self.redis.connected, lambda: len(self.gateways), lambda: self.draining)

    def load(self) -> protocol.WorkerLoad:
        queued, active, free = self.engine.load()
        return protocol.WorkerLoad(
            num_queued_requests=queued,
            num_active_requests=active,
            free_num_blocks=free,
            max_num_blocks=self.engine.info.num_blocks,
        )

    # -- the I/O thread -------------------------------------------------------------

    def serve(self) -> None:
        """Run until `self.stop` is set (by a signal handler or a test)."""
        self.redis.start()
        self._pump.start()
        info = self.engine.info
        log.info("worker %s serving %s at %s (%d compute threads)", self.worker_id, self.config.model_name,
                 self.address, info.compute_threads)  # fmt: skip
        self.notifier.ready(
            f"serving {self.config.model_name} at {self.address}: {info.backend} backend, "
            f"{info.num_blocks} KV blocks, max batch {info.max_batch_size}"
            + ("" if info.quantization is None else f", {info.quantization}")
            + ("" if info.kv_cache_dtype is None else f", {info.kv_cache_dtype} KV cache")
        )
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._pump_out, zmq.POLLIN)
        if self._kv_in is not None:
            poller.register(self._kv_in, zmq.POLLIN)
        interval = self.config.heartbeat_interval_s
        next_tick = time.monotonic() + interval
        try:
            while not self.stop.is_set():
                timeout_ms = int(max(0.0, min(next_tick - time.monotonic(), 0.1)) * 1000)
                events = dict(poller.poll(timeout_ms))
                if self._pump_out in events:
                    self._forward_results()
                self._publish_kv()
                if self._kv_in is not None and self._kv_in in events:
                    self._receive_kv(self._kv_in)
                if self.router in events:
                    self._receive()
                if self._awaiting_kv:
                    self._stop_waiting_for_kv(time.monotonic())
                while self._lora_replies:
                    self._answer_lora(self._lora_replies.popleft())
                while self._kv_answers:
                    self._answer_source(*self._kv_answers.popleft())
                if time.monotonic() >= next_tick:
                    self._tick()
                    next_tick = time.monotonic() + interval
                if self.engine.looping():  # the watchdog vouches for the executor loop, not this one
                    self.notifier.watchdog()
                if self.engine_failure:
                    self._end_all(ErrorCode.INTERNAL, f"worker failed: {self.engine_failure}")
                    break
                if self.drain.begin(len(self.table), self.notifier):
                    self._start_drain()
                if self.drain.draining and self._drained():
                    break
        finally:
            self.stop.set()
            self._pump.join(timeout=2)
            self._forward_results(itertools.count())
            self._redis_stop.set()
            self.redis.join(timeout=5)
            # A drained worker's last results and errors must leave before the socket goes.
            self.router.close(2000 if self.drain.draining else 0)
            self._pump_out.close(0)
            if self._kv_in is not None:
                self._kv_in.close(0)
            if self._curve is not None:
                self._curve.stop()
            self.ctx.term()

    # -- drain -------------------------------------------------------------------------

    def request_drain(self) -> None:
        """From a signal handler: the first call drains, a second ends the rest at once."""
        self.drain.request()

    @property
    def draining(self) -> bool:
        return self.drain.draining

    def _start_drain(self) -> None:
        self.redis.leave.set()
        drain = protocol.encode(protocol.Drain(sender_id=self.sender_id, deadline_s=self.drain.timeout_s))
        for gateway in self.gateways:
            self.router.send_multipart([gateway, drain])

    def _drained(self) -> bool:
        """True when nothing is left to wait for: every request finished, or the bound
        passed (or a second SIGTERM came) and the rest were ended with an error."""
        if not len(self.table) and not self._lora_pending and not self._awaiting_kv:
            log.info("drained: every request finished")
            return True
        why = self.drain.cut()
        if why is None:
            return False
        ended = self._end_all(ErrorCode.DRAINING, f"worker draining: {self.worker_id} is shutting down ({why})")
        log.warning("drain ended by %s: %d requests ended with the draining error", why, ended)
        return True

    def _end_all(self, code: ErrorCode, why: str) -> int:
        """End every request in flight with an error saying `why`; how many there were."""
        ended = 0
        for entry in self.table.snapshot():
            with self.table.lock:
                if self.table.get(entry.exec_id) is not entry:
                    continue  # it finished meanwhile
                self.table.remove(entry)
            if not self.engine_failure:
                self.engine.cancel_request(entry.exec_id)
            text = f"{why}; the request ended after {entry.output_tokens} tokens"
            self._send(entry.gateway, protocol.ErrorReply(code=code, message=text, request_id=entry.request_id,
                                                          worker_ended=True))
            self.metrics.finished(entry.exec_id, "draining" if code is ErrorCode.DRAINING else "error")
            ended += 1
        return ended

    def _forward_results(self, turn: Iterable[int] | None = None) -> None:
        """The pump's batches to their gateways: one socket turn's worth, or (given
        itertools.count(), at shutdown) all that are waiting."""
        for _ in socket_turn() if turn is None else turn:
            try:
                gateway, payload = self._pump_out.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if gateway in self.gateways:  # a gateway declared gone gets nothing more
                self.router.send_multipart([gateway, payload])

    def _publish_kv(self) -> None:
        """What the engine's KV cache index gained and lost since the last call, to every gateway."""
        batches = []
        while self.engine.kv_events:
            batches.append(self.engine.kv_events.popleft())
        msg = self.kv.fold(batches) if batches else None
        if msg is None:
            return
        data = protocol.encode(msg, self.limits)
        for gateway in self.gateways:
            self.router.send_multipart([gateway, data])

    # -- disaggregated serving: KV blocks in --------------------------------------------

    def _receive_kv(self, sock: zmq.Socket) -> None:
        """Transfers from prefill workers: each to the engine, ahead of the continuation
        that waits for it (the engine's pipe keeps the order)."""
        for _ in socket_turn():
            try:
                sender, *frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                header, kv = from_frames(frames, self.limits)
            except KvTransferError as e:
                log.warning("refused a KV transfer: %s", e)
                self.metrics.kv_transferred("in", "refused")
                continue
            shared = header.cuda_ipc
            if shared is not None:
                info = self.engine.info
                if shared.host_id != info.host_id or shared.device_uuid not in info.cuda_devices:
                    # Its blocks come as frames instead; the continuation waits for those.
                    log.warning("transfer %s: a CUDA IPC handle of GPU %s on %s cannot be opened here (%s); "
                                "asking for frames", header.transfer_id, shared.device_uuid, shared.host_id,
                                "no CUDA KV cache" if not info.cuda_devices else "another host or GPU")  # fmt: skip
                    self.metrics.kv_transferred("in", "unopened")
                    sock.send_multipart([sender, protocol.encode(protocol.KvAck(transfer_id=header.transfer_id,
                                                                                opened=False))])  # fmt: skip
                    continue
                self._kv_sources[header.transfer_id] = sender
                if len(self._kv_sources) > _KV_ARRIVED_KEPT:
                    self._kv_sources.popitem(last=False)
            self.engine.import_kv(header.transfer_id, self.config.model_name, kv,
                                  None if shared is None else ipc_of(shared), time.time() - header.sent_at)  # fmt: skip
            self._kv_arrived[header.transfer_id] = None
            if len(self._kv_arrived) > _KV_ARRIVED_KEPT:
                self._kv_arrived.popitem(last=False)
            if header.transfer_id in self._awaiting_kv:
                self._stop_waiting_for_kv(None, header.transfer_id)

    def _answer_source(self, transfer: str, opened: bool) -> None:
        """Tell the worker that shared a buffer that its blocks were copied (it frees the
        buffer), or that the handle did not open (it sends them as frames)."""
        sender = self._kv_sources.pop(transfer, None)
        if sender is not None and self._kv_in is not None:
            ack = protocol.KvAck(transfer_id=transfer, opened=opened)
            self._kv_in.send_multipart([sender, protocol.encode(ack, self.limits)])

    def _stop_waiting_for_kv(self, now: float | None, transfer: str | None = None) -> None:
        """Enqueue the continuation waiting for `transfer`, or (given `now`) those whose
        wait ran out: their blocks are not coming, so they compute their prompts."""
        if transfer is not None:
            waiting = [transfer]
        else:
            waiting = [t for t, (deadline, _, _) in self._awaiting_kv.items() if now is not None and now >= deadline]
        for t in waiting:
            _, key, taken = self._awaiting_kv.pop(t)
            if now is not None:
                log.warning("request %s: its KV blocks did not come within %.1f s; computing its prompt", taken[1],
                            KV_WAIT_S)  # fmt: skip
            self._taken[key] = taken
        self._enqueue_taken()

    def _receive(self) -> None:
        try:
            for _ in socket_turn():
                try:
                    frames = self._receive_authenticated(self._identity_keys)
                except zmq.Again:
                    return
                if not frames:
                    continue  # refused or answered already
                gateway, payload = frames
                self._handle(gateway, payload)
        finally:
            self._enqueue_taken()

    def _receive_authenticated(self, identity_keys: IdentityKeys) -> list[bytes]:
        """One message, or [] where its sender used the name of another gateway
        (refused and logged) or sent other than one frame (answered). Where it took
        that gateway's whole routing id, the gateway's connection had ended (libzmq
        keeps a live one): the gateway is then gone, and nothing more is sent under
        its id, which would reach the taker."""
        parts = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
        gateway = parts[0].bytes
        if len(parts) < 2 or not identity_keys.admit(gateway, parts[1]):
            if len(parts) >= 2 and gateway in self.gateways:
                self._gateway_gone(gateway, "lost its id to a peer with another key")
            return []
        if len(parts) != 2:
            self.metrics.protocol_errors.inc()
            text = f"a message is one frame (msgpack); got {len(parts) - 1} frames"
            self._send(gateway, protocol.ErrorReply(code=ErrorCode.PROTOCOL, message=text))
            return []
        return [gateway, parts[1].bytes]

    def _handle(self, gateway: bytes, payload: bytes) -> None:
        try:
            msg = protocol.decode(payload, self.limits)
        except protocol.ProtocolError as e:
            self.metrics.protocol_errors.inc()
            self._send(gateway, protocol.ErrorReply(code=ErrorCode.PROTOCOL, message=str(e), request_id=e.request_id))
            return
        peer = self.gateways.get(gateway)
        if peer is None:
            interval = msg.heartbeat_interval_s if isinstance(msg, protocol.Hello) else self.config.heartbeat_interval_s
            peer = self.gateways[gateway] = _Gateway(interval)
            log.info("gateway %r connected", identity_name(gateway))
            if not isinstance(msg, protocol.Hello):  # it knew this worker before a restart: what it held is gone
                self._send(gateway, self.kv.snapshot())
        peer.last_seen = time.monotonic()
        if isinstance(msg, protocol.SubmitBatch):
            budget = Unpacking(self.limits.max_packed_values)  # the batch's, as one message's
            for item in msg.submits:
                self._submit_item(gateway, item, budget)
        elif isinstance(msg, protocol.Submit):
            self._submit_guarded(gateway, msg)
        elif isinstance(msg, protocol.LoraLoad | protocol.LoraUnload):
            self._enqueue_taken()  # the submits before it run as they were sent: without a new adapter, or with an old
            token = next(self._lora_tokens)
            self._lora_asks[token] = (gateway, msg.request_id)
            if isinstance(msg, protocol.LoraLoad):
                self.engine.load_lora(token, msg.name, msg.path)
            else:
                self.engine.unload_lora(token, msg.name)
        elif isinstance(msg, protocol.Cancel):
            self._enqueue_taken()  # it may cancel a submit of this same turn
            if (waiting := self._lora_pending.release((gateway, msg.request_id))) is not None:
                self._enqueue_taken([waiting])  # it ends cancelled behind the load it waited for
            for transfer, (_, key, _) in list(self._awaiting_kv.items()):
                if key == (gateway, msg.request_id):  # it ends cancelled without its blocks
                    self._stop_waiting_for_kv(None, transfer)
            entry = self.table.find(gateway, msg.request_id)
            if entry is not None:
                self.engine.cancel_request(entry.exec_id)
        elif isinstance(msg, protocol.Hello):
            peer.heartbeat_interval_s = msg.heartbeat_interval_s
            info = self.engine.info
            self._send(
                gateway,
                protocol.Ready(
                    sender_id=self.sender_id,
                    role="worker",
                    heartbeat_interval_s=self.config.heartbeat_interval_s,
                    models=[self.config.model_name],
                    vocab_size=info.vocab_size,
                    max_seq_len=info.max_seq_len,
                    load=self.load(),
                    tokenizer_json=info.tokenizer_json,
                    quantization=info.quantization,
                    chat_template=info.chat_template,
                    bos_token=info.bos_token,
                    eos_token=info.eos_token,
                    lora_adapters=self.lora_adapters,
                    lora_loadable=self.lora_loadable,
                    submit_batches=True,
                ),
            )
            self._send(gateway, self.kv.snapshot())
        elif isinstance(msg, protocol.KvSnapshotRequest):
            self._send(gateway, self.kv.snapshot())
        elif isinstance(msg, protocol.Heartbeat | protocol.Drain):
            pass  # liveness is all a gateway's heartbeat says
        else:
            self._send(
                gateway,
                protocol.ErrorReply(code=ErrorCode.PROTOCOL, message=f"a worker does not accept {msg.kind} messages"),
            )

    def _submit_item(self, gateway: bytes, item: bytes, budget: Unpacking) -> None:
        """One submit of a SubmitBatch, decoded on its own: a bad one is refused alone, as if it came alone."""
        try:
            msg = protocol.decode(item, self.limits, budget)
        except protocol.ProtocolError as e:
            self.metrics.protocol_errors.inc()
            self._send(gateway, protocol.ErrorReply(code=ErrorCode.PROTOCOL, message=str(e), request_id=e.request_id))
            return
        if not isinstance(msg, protocol.Submit):
            self.metrics.protocol_errors.inc()
            text = f"a submits message carries submit messages only, not {msg.kind}"
            self._send(gateway, protocol.ErrorReply(code=ErrorCode.PROTOCOL, message=text))
            return
        self._submit_guarded(gateway, msg)

    def _submit_guarded(self, gateway: bytes, msg: protocol.Submit) -> None:
        try:
            self._submit(gateway, msg)
        except Exception as e:  # a bug on one request must not stop the worker
            log.exception("request %s: submit failed", msg.request_id)
            self._send(gateway, protocol.ErrorReply(code=ErrorCode.INTERNAL, request_id=msg.request_id,
                                                    message=f"worker failed to start the request: {e}"))  # fmt: skip

    def _submit(self, gateway: bytes, msg: protocol.Submit) -> None:
        def refuse(code: ErrorCode, text: str) -> None:
            self.metrics.rejected()
            self._send(gateway, protocol.ErrorReply(code=code, message=text, request_id=msg.request_id))

        if self.draining:
            refuse(ErrorCode.DRAINING, f"worker draining: {self.worker_id} is shutting down and takes no new requests")
        elif msg.input_token_ids is None:
            refuse(ErrorCode.INVALID_REQUEST, "workers take input_token_ids; send text prompts through a gateway")
        elif msg.model is not None and msg.model != self.config.model_name:
            refuse(ErrorCode.UNKNOWN_MODEL, f"this worker serves {self.config.model_name!r}, not {msg.model!r}")
        elif problem := too_large(msg, self.engine.info.vocab_size, self.limits):
            refuse(ErrorCode.INVALID_REQUEST, problem)
        elif (self.table.has(gateway, msg.request_id) or (gateway, msg.request_id) in self._taken
              or self._lora_pending.has((gateway, msg.request_id))
              or any(key == (gateway, msg.request_id) for _, key, _ in self._awaiting_kv.values())):  # fmt: skip
            refuse(ErrorCode.INVALID_REQUEST, f"request_id {msg.request_id!r} is already running")
        else:
            request = to_request(msg)
            if msg.kv_handoff is not None:  # a prefill: the first token here, the rest where its blocks go
                request.max_tokens = 1
                self._handoffs[gateway, msg.request_id] = msg.kv_handoff
            taken = ((gateway, msg.request_id), (request, msg.client_request_id or msg.request_id))
            transfer = msg.kv_transfer_id
            if (transfer is not None and transfer not in self._kv_arrived and transfer not in self._awaiting_kv
                    and self._kv_in is not None):  # fmt: skip
                self._awaiting_kv[transfer] = (time.monotonic() + KV_WAIT_S, *taken)
            elif not self._load_on_demand(msg.lora, taken):
                self._taken[gateway, msg.request_id] = taken[1]

    def _load_on_demand(self, name: str | None, taken: Taken) -> bool:
        """Whether the request waits for its adapter, not held but in --lora-dir, to load
        (through the engine as a LoraLoad: what is sent after it waits, running requests step on)."""
        if name is None or name in self.lora_adapters:
            return False
        if self._lora_pending.join(name, taken):
            return True  # its load is under way
        path = self._lora_dir.path(name)
        if path is None:
            return False  # the engine says it is unknown
        self._enqueue_taken()  # the submits before it keep their order
        token = next(self._lora_tokens)
        self._lora_pending.start(token, name, taken)
        log.info("loading LoRA adapter %r from %s for request %s", name, path, taken[0][1])
        self.engine.load_lora(token, name, path)
        return True

    def _enqueue_taken(self, waited: list[Taken] | None = None) -> None:
        """Hand a socket turn's submits to the executor together. A burst of requests
        then reaches it as one batch: one prefill step, not a step for each request
        that got through while this thread waited for the GIL between messages.
        `waited`: requests that waited for their adapter's load instead."""
        if waited is not None:
            taken = dict(waited)
        elif not self._taken:
            return
        else:
            taken, self._taken = self._taken, {}
        if not taken:
            return
        with self.table.lock:
            try:
                hand_offs = {i: self._kv_transport.choose(self._handoffs[key].kv_address)
                             for i, key in enumerate(taken) if key in self._handoffs}  # fmt: skip
                exec_ids = self.engine.enqueue_requests([request for request, _ in taken.values()], hand_offs,
                                                        self.config.model_name)  # fmt: skip
            except Exception as e:  # a bug here must not stop the worker
                log.exception("could not enqueue %d requests", len(taken))
                text = f"worker failed to start the request: {e}"
                for gateway, request_id in taken:
                    self._handoffs.pop((gateway, request_id), None)
                    error = protocol.ErrorReply(code=ErrorCode.INTERNAL, message=text, request_id=request_id)
                    self._send(gateway, error)
                return
            for exec_id, ((gateway, request_id), (request, name)) in zip(exec_ids, taken.items(), strict=True):
                entry = Active(exec_id, gateway, request_id, name, len(request.input_token_ids))
                self.table.add(entry)
                self.metrics.started(exec_id, entry.prompt_tokens, entry.received)
                handoff = self._handoffs.pop((gateway, request_id), None)
                if handoff is not None:
                    self._handing_off[exec_id] = handoff

    def _answer_lora(self, reply: LoraReply) -> None:
        """The engine's answer to a LoRA load or unload: to the peer that asked, and
        the adapters now held to every other gateway and to the registry."""
        asker = self._lora_asks.pop(reply.token, None)
        adapters = list(reply.adapters)
        self._announce_lora(adapters, None if asker is None else asker[0])
        waited = self._lora_pending.finish(reply.token)
        if waited is not None:
            self._loaded_on_demand(reply, waited)
        if asker is None:
            return
        gateway, request_id = asker
        if reply.error is not None:
            log.warning("%s", reply.error)
            self._send(gateway, protocol.ErrorReply(code=ErrorCode.INVALID_REQUEST, message=reply.error,
                                                    request_id=request_id))  # fmt: skip
        else:
            self._send(gateway, protocol.LoraAdapters(sender_id=self.sender_id, adapters=adapters,
                                                      loadable=self.lora_loadable, request_id=request_id))  # fmt: skip

    def _loaded_on_demand(self, reply: LoraReply, waited: list[Taken]) -> None:
        """The requests that waited for their adapter run now, or fail with why it did not load."""
        if reply.error is None:
            self._enqueue_taken(waited)
            return
        log.warning("%s", reply.error)
        for (gateway, request_id), _ in waited:
            self.metrics.rejected()
            self._send(gateway, protocol.ErrorReply(code=ErrorCode.INVALID_REQUEST, message=reply.error,
                                                    request_id=request_id))  # fmt: skip

    def _announce_lora(self, adapters: list[str], but: bytes | None = None) -> None:
        """Tell every gateway (but `but`) and the registry the adapters held and the ones
        --lora-dir holds besides, when either changed (--lora-dir is read again for it)."""
        loadable = [n for n in self._lora_dir.names() if n not in adapters]
        if adapters == self.lora_adapters and loadable == self.lora_loadable:
            return
        self.lora_adapters, self.lora_loadable = adapters, loadable
        update = {"lora_adapters": adapters, "lora_loadable": loadable}
        self.redis.info = self.redis.info.model_copy(update=update)  # one reference swap
        notice = protocol.LoraAdapters(sender_id=self.sender_id, adapters=adapters, loadable=loadable)
        for gateway in self.gateways:
            if gateway != but:
                self._send(gateway, notice)

    def _gateway_gone(self, gateway: bytes, why: str) -> None:
        orphans = self.table.of_gateway(gateway)
        log.warning("gateway %r %s: aborting its %d requests", identity_name(gateway), why, len(orphans))
        for entry in orphans:
            self.engine.cancel_request(entry.exec_id)
        self._lora_pending.drop_gateway(gateway)
        self._awaiting_kv = {t: w for t, w in self._awaiting_kv.items() if w[1][0] != gateway}
        del self.gateways[gateway]

    def _send(self, gateway: bytes, msg: protocol.Message) -> None:
        self.router.send_multipart([gateway, protocol.encode(msg, self.limits)])

    def _tick(self) -> None:
        now = time.monotonic()
        for gateway, peer in list(self.gateways.items()):
            if now - peer.last_seen > self.config.missed_heartbeats * peer.heartbeat_interval_s:
                self._gateway_gone(gateway, f"silent for {now - peer.last_seen:.1f} s")
                name = identity_name(gateway)
                if all(identity_name(g) != name for g in self.gateways):
                    self._identity_keys.forget(name)
        load = self.load()
        # The line `systemctl status` shows, kept current.
        self.notifier.status(
            f"{'draining' if self.draining else 'serving'} {self.config.model_name}: "
            f"{load.num_active_requests} active, {load.num_queued_requests} queued, "
            f"{load.free_num_blocks}/{load.max_num_blocks} KV blocks free, {len(self.gateways)} gateways"
        )
        if self._lora_dir.root is not None:
            self._announce_lora(self.lora_adapters)  # adapters copied into (or out of) --lora-dir
        beat = protocol.encode(protocol.Heartbeat(sender_id=self.sender_id, load=load))
        for gateway in self.gateways:
            self.router.send_multipart([gateway, beat])

    # -- the result pump ---------------------------------------------------------------

    def _pump_results(self) -> None:
        out = self.ctx.socket(zmq.PAIR)
        out.setsockopt(zmq.SNDHWM, 0)
        out.connect(_PUMP_ENDPOINT)
        exec_stats: dict[int, ex.RequestStats] = {}
        try:
            while not self.stop.is_set():
                try:
                    step = self.engine.await_step(timeout=0.1)
                except EngineFailed as e:
                    log.critical("%s: the worker stops", e)
                    self.engine_failure = str(e)
                    return
                if isinstance(step, LoraReply):
                    self._lora_replies.append(step)  # answered by the I/O thread, which owns the socket
                elif isinstance(step, KvImported):
                    self._imported(step)
                elif isinstance(step, KvExported):
                    self._kv_out.resend(step)
                elif step is not None:
                    try:
                        self._deliver(step, out, exec_stats)
                    except Exception:  # keep pumping: one bad response must not hang every stream
                        log.exception("result pump: could not deliver a step of %d streams", len(step.ids))
                self.ended_log.summarize(time.monotonic())
                self._kv_out.take_answers()
        finally:
            self.ended_log.summarize(time.monotonic(), force=True)
            out.close(0)
            self._kv_out.close()

    def _imported(self, done: KvImported) -> None:
        if done.ipc:
            self._kv_answers.append((done.transfer_id, done.opened))  # the I/O thread owns the socket
        if not done.opened:
            log.warning("transfer %s: the CUDA IPC handle did not open (%s); asking for frames", done.transfer_id,
                        done.error)  # fmt: skip
            self.metrics.kv_transferred("in", "unopened")
            return
        if done.error is not None:
            log.warning("refused the KV blocks of transfer %s: %s", done.transfer_id, done.error)
            self.metrics.kv_transferred("in", "refused")
            return
        self.metrics.kv_transferred("in", "copied" if done.ipc else "ok", done.num_bytes, done.seconds)
        log.debug("transfer %s: %d KV blocks imported in %.3f s", done.transfer_id, done.num_blocks, done.seconds)

    def _hand_off(self, entry: Active, handoff: protocol.KvHandoff, exported: KvExported, out: zmq.Socket) -> None:
        """A prefill's blocks to its decode worker, then the gateway told to continue it there."""
        blocks = self._kv_out.send(handoff, exported, entry.name)
        done = protocol.HandedOff(request_id=entry.request_id, transfer_id=handoff.transfer_id, num_blocks=blocks)
        out.send_multipart([entry.gateway, protocol.encode(done, self.limits)])

    def _deliver(self, step: StepOutput, out: zmq.Socket, exec_stats: dict[int, ex.RequestStats]) -> None:
        """One result batch per gateway for one message of the engine."""
        batches: dict[bytes, WireBatch] = {}
        finished: list[tuple[Active, protocol.Response]] = []
        exports = {e.exec_id: e for e in self.engine.kv_exports}
        handed: list[tuple[Active, protocol.KvHandoff, KvExported]] = []
        chunks: list[tuple[object, int]] = []
        with self.table.lock:
            end = 0
            for exec_id, n in zip(step.ids, step.counts, strict=True):
                start, end = end, end + n
                entry = self.table.get(exec_id)
                if entry is None:
                    continue
                batch = batches.get(entry.gateway) or batches.setdefault(entry.gateway, WireBatch())
                batch.add_streamed(entry.request_id, step.token_ids[start:end])
                entry.output_tokens += n
                chunks.append((exec_id, n))
            for r in step.responses:
                final = r.result is None or r.result.is_final
                handoff = self._handing_off.pop(r.request_id, None) if final else None
                entry = self.table.get(r.request_id)
                if entry is None:
                    continue
                batch = batches.get(entry.gateway) or batches.setdefault(entry.gateway, WireBatch())
                if handoff is not None and ends_for_hand_off(r) and r.result is not None:
                    # Its first token streams as usual; its end is the decode worker's to send.
                    tokens = r.result.output_token_ids[0]
                    if tokens:
                        batch.add_streamed(entry.request_id, tokens)
                    entry.output_tokens += len(tokens)
                    chunks.append((entry.exec_id, len(tokens)))
                    self.table.remove(entry)
                    handed.append((entry, handoff, exports.get(entry.exec_id, KvExported(entry.exec_id, None))))
                    continue
                wire = batch.add(entry.request_id, r)
                result = r.result
                if result is not None:
                    ids = result.output_token_ids
                    n = len(ids[0]) if len(ids) == 1 else sum(map(len, ids))
                    entry.output_tokens += n
                    chunks.append((entry.exec_id, n))
                if result is None or result.is_final:
                    self.table.remove(entry)
                    finished.append((entry, wire))
        load = self.load().model_dump(exclude_defaults=True)
        unsent: dict[tuple[bytes, str], protocol.Response] = {}  # each went as an error response instead
        for gateway, batch in batches.items():
            messages, errors = batch.messages(load, self.limits)
            for data in messages:
                out.send_multipart([gateway, data])
            unsent.update(((gateway, request_id), error) for request_id, error in errors.items())
        for entry, handoff, exported in handed:
            self._hand_off(entry, handoff, exported, out)
            self.metrics.finished(entry.exec_id, "handed_off")
        if unsent:
            finished = [(e, unsent.get((e.gateway, e.request_id), w)) for e, w in finished]
            for (gateway, request_id), error in unsent.items():
                entry = self._end_unsent(gateway, request_id, error)
                if entry is not None:
                    finished.append((entry, error))
        self.metrics.streams.tokens(chunks)  # before finished() forgets the streams' timings
        for entry, wire in finished:
            self.metrics.finished(entry.exec_id, outcome(wire))
        for s in step.request_stats:
            exec_stats[s.request_id] = s
            self.metrics.speculated(s.num_draft_tokens, s.num_accepted_draft_tokens)
        self.metrics.preempted(sum(it.num_preempted for it in step.iteration_stats))
        if step.iteration_stats:
            self.metrics.kv_cache(step.iteration_stats[-1])
        if finished:
            self.redis.record_requests([self._record_finished(entry, wire, exec_stats.pop(entry.exec_id, None))
                                        for entry, wire in finished])  # fmt: skip
            if len(exec_stats) > 10_000:  # stats of requests never seen final: forget
                exec_stats.clear()

    def _end_unsent(self, gateway: bytes, request_id: str, error: protocol.Response) -> Active | None:
        """A request whose response could not be sent got an error response instead: if it
        was still running, it ends here too (the entry, to record as finished)."""
        entry = self.table.find(gateway, request_id)
        with self.table.lock:
            if entry is None or self.table.get(entry.exec_id) is not entry:
                return None  # that response was its final: it is among the finished already
            self.table.remove(entry)
        log.warning("request %s: %s", entry.name, error.error_msg)
        self.engine.cancel_request(entry.exec_id)
        return entry

    def _record_finished(self, entry: Active, wire: protocol.Response,
                         stats: ex.RequestStats | None) -> tuple[str, dict[str, str]]:  # fmt: skip
        """Its stats record for Redis (by its name), counted and logged (ended_log.py)."""
        fields = {
            "request_id": entry.name,
            "gateway": identity_name(entry.gateway).decode(errors="replace"),
            "worker": self.worker_id,
            "prompt_tokens": str(entry.prompt_tokens),
            "output_tokens": str(entry.output_tokens),
            "e2e_ms": f"{(time.monotonic() - entry.received) * 1e3:.3f}",
        }
        if wire.result is not None:
            fields["finish_reason"] = ",".join(f.name.lower() for f in wire.result.finish_reasons)
        else:
            fields["finish_reason"] = "error"
            fields["error"] = wire.error_msg or ""
        if stats is not None and stats.queue_time_ms is not None:
            self.metrics.queued(stats.queue_time_ms / 1e3)
        for name, key in (("queue_time_ms", "queue_time_ms"), ("time_to_first_token_ms", "ttft_ms")):
            value = getattr(stats, name, None)
            if value is not None:
                fields[key] = f"{value:.3f}"
        if stats is not None and stats.num_draft_tokens:
            fields["draft_tokens"] = str(stats.num_draft_tokens)
            fields["accepted_draft_tokens"] = str(stats.num_accepted_draft_tokens)
        if stats is not None and stats.speculation_off_reason:
            fields["speculation_off"] = stats.speculation_off_reason
        self.ended_log.ended(entry.name, fields)
        return entry.name, fields
