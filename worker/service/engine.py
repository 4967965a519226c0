"""The executor in a process of its own (the engine), and the worker's handle on it.

Why a process: on a GPU, a small model's decode step is mostly Python, so the
executor's thread is CPU-bound and every other thread of its process takes GIL
time from it. With the worker's socket, result-pump and Redis threads beside it,
the executor held 79% of the GIL and an H200's 64-stream decode step took
1.9-3.1 ms against 1.5-2.5 ms in process. The engine process holds the executor,
whose own thread sends results over a pipe, and a main thread that takes requests
from another; everything else stays in the worker process.

Requests cross as pickled executor dataclasses with ids the worker assigns; a
plain streamed step (protocol.StreamedTokens's kind) crosses in columns, as on the
wire, since pickling 64 Responses a step would cost the engine more than it saves.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.executor import types as ex
from worker.service.convert import streamed_step

if TYPE_CHECKING:
    from worker.executor import Executor

log = logging.getLogger(__name__)

# The executor loop turns at least once a second when idle (with an on_iteration
# hook); a loop that has not turned for twice that is stuck.
LOOP_STUCK_AFTER_S = 2.0
_IDLE_LOAD_S = 0.5  # an idle engine reports its load at each idle turn of its loop, this far apart at least
_ITERATION_STATS_S = 0.1  # iteration stats cross in batches, not every step
_PIPE_BYTES = 1 << 20  # Linux's pipe-max-size for unprivileged processes


class EngineFailed(RuntimeError):
    """The engine process could not start, or ended."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine process builds its executor from (the worker's options)."""

    model: str  # checkpoint directory, .gguf file, or the default model's name
    max_batch_size: int
    max_num_tokens: int
    max_beam_width: int
    kv_tokens: int | None
    logits_post_processors: tuple[str, ...]
    backend: str  # auto, numpy, torch, or echo (transport tests: computes nothing)
    device: str | None
    log_level: str
    log_format: str
    test_hang_loop_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model_path: Path
    backend: str
    num_blocks: int
    max_batch_size: int
    vocab_size: int
    max_seq_len: int
    tokenizer_json: bytes | None
    iteration_stats_max: int


@dataclass(slots=True)
class Step:
    """What the engine produced since its last message.

    Plain streamed steps in columns: `ids[i]` got `counts[i]` tokens, in order in
    `token_ids`; every other response whole in `responses`, each after the columns
    of its request (a request's streamed steps came first). `request_stats` holds the
    stats of requests that ended here."""

    ids: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    responses: list[ex.Response] = field(default_factory=list)
    request_stats: list[ex.RequestStats] = field(default_factory=list)
    iteration_stats: list[ex.IterationStats] = field(default_factory=list)
    load: tuple[int, int, int] = (0, 0, 0)


# -- the worker's side ----------------------------------------------------------------


class EngineProcess:
    """Starts the engine and waits for its model; then the worker's executor API:
    `enqueue_requests`, `cancel_request` (any thread), `await_step` (one thread),
    `load`, `get_latest_iteration_stats`."""

    def __init__(self, config: EngineConfig) -> None:
        ctx = multiprocessing.get_context("spawn")  # CUDA does not survive fork
        to_engine, self._to = ctx.Pipe(duplex=False)
        self._from, from_engine = ctx.Pipe(duplex=False)
        for end in (self._to, self._from):
            _widen(end)
        self._turned = ctx.Value("d", time.monotonic(), lock=False)
        self.process = ctx.Process(
            target=_engine_main, args=(config, to_engine, from_engine, self._turned), name="tokenwire-engine"
        )
        self.process.start()
        to_engine.close()  # the engine's ends: its exit must read as end-of-file here
        from_engine.close()
        self._send_lock = threading.Lock()
        self._ids = 0
        self._stats_lock = threading.Lock()
        self.info: EngineInfo = self._wait_ready()
        self._load = (0, 0, self.info.num_blocks)  # a new executor's, until it reports
        self._iterations: collections.deque[ex.IterationStats] = collections.deque(maxlen=self.info.iteration_stats_max)

    def _wait_ready(self) -> EngineInfo:
        while not self._from.poll(0.5):
            if not self.process.is_alive():
                raise EngineFailed(f"the engine process exited with code {self.process.exitcode} while loading")
        kind, body = pickle.loads(self._recv())
        if kind == "failed":
            self.process.join(10)
            raise EngineFailed(body)
        return body

    def enqueue_requests(self, requests: Sequence[ex.Request]) -> list[int]:
        """Ids for the requests, at once; a request the executor refuses ends with an
        error response, as in process."""
        with self._send_lock:
            ids = list(range(self._ids + 1, self._ids + 1 + len(requests)))
            self._ids += len(requests)
            self._send(("submit", list(zip(ids, requests, strict=True))))
        return ids

    def cancel_request(self, request_id: int) -> None:
        with self._send_lock:
            self._send(("cancel", request_id))

    def await_step(self, timeout: float) -> Step | None:
        """The engine's next message, or None after `timeout` seconds."""
        if not self._from.poll(timeout):
            return None
        step: Step = pickle.loads(self._recv())
        self._load = step.load
        if step.iteration_stats:
            with self._stats_lock:
                self._iterations.extend(step.iteration_stats)
        return step

    def load(self) -> tuple[int, int, int]:
        """(queued, active, free KV blocks) as of the engine's latest message."""
        return self._load

    def get_latest_iteration_stats(self) -> list[ex.IterationStats]:
        with self._stats_lock:
            stats = list(self._iterations)
            self._iterations.clear()
        return stats

    def looping(self) -> bool:
        """Whether the executor loop turned lately (the systemd watchdog's question)."""
        return time.monotonic() - self._turned.value < LOOP_STUCK_AFTER_S

    def shutdown(self, timeout_s: float = 10.0) -> None:
        try:
            with self._send_lock:
                self._send(("stop", None))
        except EngineFailed:
            pass  # it is gone already
        self.process.join(timeout_s)
        if self.process.is_alive():
            log.warning("the engine process did not stop within %.0f s: killing it", timeout_s)
            self.process.kill()
            self.process.join()

    def _send(self, message: tuple[str, Any]) -> None:
        try:
            self._to.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
        except OSError as e:
            raise EngineFailed(f"the engine process is gone (exit code {self.process.exitcode})") from e

    def _recv(self) -> bytes:
        try:
            return self._from.recv_bytes()
        except (EOFError, OSError) as e:
            self.process.join(5)
            raise EngineFailed(f"the engine process ended (exit code {self.process.exitcode})") from e


def _widen(pipe: Connection) -> None:
    """A burst of 64 submits of 128 tokens pickles to ~80 kB: with Linux's default
    64 kB pipe the I/O thread would wait for the engine to read."""
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)


# -- the engine's side ----------------------------------------------------------------


def build_executor(config: EngineConfig, on_iteration: Callable[[], None] | None = None) -> tuple[Executor, Path]:
    from worker.executor import Executor, ExecutorConfig, KvCacheConfig
    from worker.models.default_model import resolve_model

    path = Path(config.model) if Path(config.model).exists() else resolve_model(config.model)
    executor_config = ExecutorConfig(
        max_batch_size=config.max_batch_size,
        max_num_tokens=config.max_num_tokens,
        max_beam_width=config.max_beam_width,
        kv_cache_config=KvCacheConfig(max_tokens=config.kv_tokens),
        logits_post_processors=config.logits_post_processors,
        backend="auto" if config.backend == "echo" else config.backend,
        device=config.device,
    )
    if config.backend != "echo":
        return Executor(path, executor_config, on_iteration=on_iteration), path
    from worker.models.loader import load_model
    from worker.service.echo_backend import EchoBackend

    log.warning("echo backend: TRANSPORT TEST ONLY, no model runs")
    meta = load_model(path, load_weights=False)  # config and tokenizer: gateways detokenize as usual
    backend = EchoBackend(meta.config)
    return Executor(path, executor_config, backend=backend, tokenizer=meta.tokenizer, on_iteration=on_iteration), path


def _engine_main(config: EngineConfig, inbox: Connection, outbox: Connection, turned: ctypes.c_double) -> None:
    from ops.logs import setup_logging
    from ops.process import exit_on_thread_crash, settle_gc

    # The worker process decides when this one stops: a terminal's Ctrl-C reaches
    # the whole process group (so may a supervisor's SIGTERM), and the worker drains first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging("worker", config.log_level, config.log_format)
    exit_on_thread_crash()
    engine = _Engine(outbox, turned, config.test_hang_loop_after_s)
    try:
        executor, path = build_executor(config, engine.on_turn)
    except Exception as e:
        log.exception("the engine could not load %s", config.model)
        engine.send(("failed", f"could not load {config.model}: {type(e).__name__}: {e}"))
        return
    tokenizer = executor.tokenizer
    engine.send(("ready", EngineInfo(
        model_path=path,
        backend=executor.backend.name,
        num_blocks=executor.blocks.num_blocks,
        max_batch_size=executor.config.max_batch_size,
        vocab_size=executor.model_config.vocab_size,
        max_seq_len=executor.max_seq_len,
        tokenizer_json=None if tokenizer is None else tokenizer.to_str().encode(),
        iteration_stats_max=executor.config.iteration_stats_max,
    )))  # fmt: skip
    settle_gc()
    engine.executor = executor  # from here on its loop sends results
    engine.take_requests(inbox)
    executor.shutdown()


def _receive(inbox: Connection) -> tuple[str, Any]:
    try:
        message: tuple[str, Any] = pickle.loads(inbox.recv_bytes())
    except (EOFError, OSError):
        # The worker process is gone (kill -9 leaves no time for "stop"): nobody
        # is left to serve, and the device must be freed now.
        log.warning("the worker process is gone: the engine exits")
        os._exit(1)
    return message


class _Engine:
    """Requests in on the main thread (`take_requests`); results out from the
    executor's own thread, at the start of each turn of its loop (`on_turn`), so
    that no other thread waits for the GIL to pass a step on: a sender thread
    delivered some steps two at a time. The id maps are under one lock, held
    across each enqueue, so that no response is seen before its id is mapped."""

    def __init__(self, outbox: Connection, turned: ctypes.c_double, hang_after_s: float | None) -> None:
        self.outbox = outbox
        self.turned = turned  # the worker's watchdog reads it
        self.hang_at = None if hang_after_s is None else time.monotonic() + hang_after_s
        self.executor: Executor | None = None
        self.lock = threading.Lock()
        self.worker_id: dict[int, int] = {}  # executor id -> the worker's id
        self.executor_id: dict[int, int] = {}
        # Held from taking responses to sending them: two threads' steps keep their order.
        self.send_lock = threading.Lock()
        self.last_sent = self.last_stats = time.monotonic()

    def send(self, message: object) -> None:
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            self.outbox.send_bytes(data)

    def on_turn(self) -> None:
        """The executor's on_iteration hook."""
        if self.hang_at is not None and time.monotonic() >= self.hang_at:
            log.warning("--test-hang-loop-after: the executor loop hangs now")
            threading.Event().wait()
        self.turned.value = time.monotonic()
        if self.executor is not None:
            self.send_results(self.executor)

    def send_results(self, executor: Executor) -> None:
        """What the executor has produced, if anything (an idle engine still reports
        its load every _IDLE_LOAD_S)."""
        with self.send_lock:
            responses = executor.await_responses(None, timeout=0)
            now = time.monotonic()
            if not responses and now - self.last_sent < _IDLE_LOAD_S:
                return
            step = self._step(executor, responses)
            if now - self.last_stats >= _ITERATION_STATS_S:
                step.iteration_stats = executor.get_latest_iteration_stats()
                self.last_stats = now
            step.load = executor.load()
            self.outbox.send_bytes(pickle.dumps(step, pickle.HIGHEST_PROTOCOL))
            self.last_sent = now

    def take_requests(self, inbox: Connection) -> None:
        """Until the worker says stop."""
        assert self.executor is not None
        while True:
            kind, body = _receive(inbox)
            submits: list[tuple[int, ex.Request]] = []
            while kind == "submit":  # the submits waiting behind it go into the same enqueue
                submits += body
                if not inbox.poll(0):
                    kind = ""
                    break
                kind, body = _receive(inbox)
            if submits:
                self._enqueue(self.executor, submits)
                # Requests the executor refused have their errors ready now, and
                # with nothing else to do its loop would not turn to send them.
                self.send_results(self.executor)
            if kind == "cancel":
                with self.lock:
                    executor_id = self.executor_id.get(body)
                if executor_id is not None:
                    self.executor.cancel_request(executor_id)
            elif kind == "stop":
                return

    def _enqueue(self, executor: Executor, submits: list[tuple[int, ex.Request]]) -> None:
        errors: list[ex.Response] = []
        with self.lock:
            try:
                ids = executor.enqueue_requests([request for _, request in submits])
            except Exception as e:  # a bug here must not stop the engine
                log.exception("could not enqueue %d requests", len(submits))
                errors = [ex.Response(i, error_msg=f"worker failed to start the request: {e}") for i, _ in submits]
            else:
                for executor_id, (worker_id, _) in zip(ids, submits, strict=True):
                    self.worker_id[executor_id] = worker_id
                    self.executor_id[worker_id] = executor_id
        if errors:
            self.send(Step(responses=errors, load=executor.load()))

    def _step(self, executor: Executor, responses: list[ex.Response]) -> Step:
        step = Step()
        ended: list[int] = []
        with self.lock:
            for r in responses:
                tokens = streamed_step(r)
                if tokens is not None:
                    step.ids.append(self.worker_id[r.request_id])
                    step.counts.append(len(tokens))
                    step.token_ids += tokens
                    continue
                if r.result is None or r.result.is_final:
                    ended.append(r.request_id)
                r.request_id = self.worker_id[r.request_id]
                step.responses.append(r)
            if ended:
                for s in executor.get_latest_request_stats():
                    s.request_id = self.worker_id.get(s.request_id, -1)
                    step.request_stats.append(s)
                for executor_id in ended:
                    del self.executor_id[self.worker_id.pop(executor_id)]
        return step
