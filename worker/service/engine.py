"""The engine core in a process of its own (the engine), and the worker's handle on it.

Why a process: on a GPU, a small model's decode step is mostly Python, so the
thread that steps the core is CPU-bound and every other thread of its process
takes GIL time from it. With the worker's socket, result-pump and Redis threads
beside it, the executor held 79% of the GIL and an H200's 64-stream decode step
took 1.9-3.1 ms against 1.5-2.5 ms in process. The engine process has one
thread: it reads what waits in its pipe without blocking, runs `core.step()` and
sends the step's output, so nothing waits for the GIL to pass a step on. (A LoRA adapter
loaded at run time is read on a second thread, for as long as that takes: the steps of
the requests running meanwhile go on.)

Requests cross as pickled executor dataclasses under ids the worker assigns (the
core answers under the caller's ids: no id maps); a step crosses as the core's
`StepOutput`, plain streamed steps in columns as on the wire.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import functools
import logging
import multiprocessing
import os
import pickle
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.executor import types as ex
from worker.executor.block_manager import BlockEvent
from worker.executor.engine_core import StepOutput
from worker.executor.kv_export import KvBlocks
from worker.service.engine_kv import (
    EngineKv,
    KvExported,
    KvImported,
    Returned,
    cuda_devices,
    host_id,
)
from worker.service.kv_transport import Transport

if TYPE_CHECKING:
    from worker.executor import EngineCore
    from worker.executor.kv_shared import IpcBuffer
    from worker.models.lora import LoraAdapter

log = logging.getLogger(__name__)

# An idle engine turns its loop (and reports its load) this often at least.
_IDLE_LOAD_S = 0.5
# A loop that has not turned for this long is stuck (the systemd watchdog's question).
LOOP_STUCK_AFTER_S = 2.0
_ITERATION_STATS_S = 0.1  # iteration stats cross in batches, not every step
_PIPE_BYTES = 1 << 20  # Linux's pipe-max-size for unprivileged processes
_STALLED_WAIT_S = 0.001  # a stalled core steps again this often: an adapter being read gives no sign
_READ_POLL_S = 0.01  # an idle engine reading a LoRA adapter looks this often whether it is done


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
    # Speculative decoding for requests that do not choose (None: off), and the draft model's checkpoint.
    speculative_config: ex.SpeculativeConfig | None = None
    draft_model: str | None = None
    # Threads the model's math libraries may run (None: all usable cores but one; ops/compute_threads.py).
    cpu_threads: int | None = None
    # More than one rank: this process starts the others (worker/parallel/ranks.py) and
    # ends when any of them does, so the worker sees one engine fail as a whole.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel: bool = False  # MoE layers: whole experts per tensor-parallel rank
    quantization: str | None = None  # fp8 | int4: quantize a float checkpoint on load
    kv_cache_dtype: str | None = None  # fp8: an e4m3 KV cache; None: the model's dtype
    # LoRA adapters registered at start (name, PEFT directory), and the adapter cache's bounds;
    # LoRA is on (device slots set aside before the KV cache is sized) when either is given.
    lora_adapters: tuple[tuple[str, str], ...] = ()
    peft_cache_config: ex.PeftCacheConfig | None = None
    scheduler_policy: str = "guaranteed_no_evict"  # a CapacitySchedulerPolicy's value
    deterministic: bool = False  # logits independent of batch-mates (ExecutorConfig.deterministic)
    host_kv_cache_bytes: int = 0  # the KV cache's host tier (KvCacheConfig.host_cache_size); 0: off


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
    quantization: str | None = None  # what the model runs as (Ready, logs); None: float
    kv_cache_dtype: str | None = None  # "fp8"; None: the model's dtype
    # For gateways rendering chat messages (protocol.Ready): the template and the tokens it names.
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    lora_adapters: tuple[str, ...] = ()  # registered at start
    compute_threads: int = 1  # what the math libraries report after --cpu-threads
    block_size: int = 32  # tokens per KV block (KvCacheConfig.tokens_per_block): what gateways hash prompts by
    # Where the KV cache is on CUDA: the UUIDs of the GPUs the engine sees and its host's id,
    # what CUDA IPC handles of KV blocks are checked against (worker/backends/torch_kv_ipc.py).
    cuda_devices: tuple[str, ...] = ()
    host_id: str = ""


@dataclass(frozen=True, slots=True)
class LoraReply:
    """The engine's answer to a LoRA load or unload (`token` names the ask): the adapters
    it holds now, and what went wrong, if anything did."""

    token: int
    adapters: tuple[str, ...]
    error: str | None = None


# -- the worker's side ----------------------------------------------------------------


class EngineProcess:
    """Starts the engine and waits for its model; then the worker's API on it:
    `enqueue_requests`, `cancel_request`, `load_lora`, `unload_lora` (any thread),
    `await_step` (one thread), `load`, `get_latest_iteration_stats`."""

    def __init__(self, config: EngineConfig) -> None:
        ctx = multiprocessing.get_context("spawn")  # CUDA does not survive fork
        to_engine, self._to = ctx.Pipe(duplex=False)
        self._from, from_engine = ctx.Pipe(duplex=False)
        for end in (self._to, self._from):
            _widen(end)
        self._turned = ctx.Value("d", time.monotonic(), lock=False)
        self.process = ctx.Process(
            target=_engine_main, args=(config, to_engine, from_engine, self._turned, os.getpid()),
            name="tokenwire-engine",
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
        # The block manager's index changes, one list per engine message, for the worker to publish.
        self.kv_events: collections.deque[list[BlockEvent]] = collections.deque()
        # The blocks of handed-off requests that ended with the step `await_step` returned last.
        self.kv_exports: list[KvExported] = []

    def _wait_ready(self) -> EngineInfo:
        while not self._from.poll(0.5):
            if not self.process.is_alive():
                raise EngineFailed(f"the engine process exited with code {self.process.exitcode} while loading")
        kind, body = pickle.loads(self._recv())
        if kind == "failed":
            self.process.join(10)
            raise EngineFailed(body)
        return body

    def enqueue_requests(self, requests: Sequence[ex.Request], hand_offs: Mapping[int, Transport] | None = None,
                         model: str = "") -> list[int]:  # fmt: skip
        """Ids for the requests, at once; a request the executor refuses ends with an
        error response, as in process. `hand_offs`: the indexes of requests whose KV
        blocks (of model `model`) are exported when they end after their first token
        (`kv_exports`), and how: watched from before they run, however fast they end."""
        with self._send_lock:
            ids = list(range(self._ids + 1, self._ids + 1 + len(requests)))
            self._ids += len(requests)
            watched = [(ids[i], requests[i].input_token_ids, model, how) for i, how in (hand_offs or {}).items()]
            self._send(("submit", (list(zip(ids, requests, strict=True)), watched)))
        return ids

    def cancel_request(self, request_id: int) -> None:
        with self._send_lock:
            self._send(("cancel", request_id))

    def load_lora(self, token: int, name: str, path: str) -> None:
        """Register a LoRA adapter; the engine answers with a LoraReply under `token`
        (from `await_step`). Requests enqueued after this call see it."""
        with self._send_lock:
            self._send(("lora_load", (token, name, path)))

    def unload_lora(self, token: int, name: str) -> None:
        with self._send_lock:
            self._send(("lora_unload", (token, name)))

    def import_kv(self, transfer_id: str, model: str, kv: KvBlocks, ipc: IpcBuffer | None = None,
                  age_s: float = 0.0) -> None:  # fmt: skip
        """Write another worker's KV blocks (or those of the buffer it shared `age_s` seconds
        ago by CUDA IPC) into the prefix cache before whatever is sent after this call;
        the engine answers with a KvImported (from `await_step`)."""
        with self._send_lock:
            self._send(("kv_import", (transfer_id, model, kv, ipc, age_s)))

    def return_kv(self, exec_id: int, outcome: Returned) -> None:
        """How the loan of request `exec_id`'s buffer ended (EngineKv.returned): where the
        decode worker could not open it, the engine answers with its blocks as a
        KvExported (from `await_step`), to be sent as frames."""
        with self._send_lock:
            self._send(("kv_return", (exec_id, outcome)))

    def await_step(self, timeout: float) -> StepOutput | LoraReply | KvImported | KvExported | None:
        """The engine's next step output (or answer to a LoRA load or unload, to a KV
        import, or to a shared buffer's return), or None after `timeout` seconds."""
        if not self._from.poll(timeout):
            return None
        message = pickle.loads(self._recv())
        if isinstance(message, LoraReply | KvImported | KvExported):
            return message
        step: StepOutput
        step, self._load, kv_events, self.kv_exports = message
        if kv_events:
            self.kv_events.append(kv_events)
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
        """Whether the engine's loop turned lately (the systemd watchdog's question)."""
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


def build_core(config: EngineConfig) -> tuple[EngineCore, Path]:
    from worker.executor import (
        CapacitySchedulerPolicy,
        EngineCore,
        ExecutorConfig,
        KvCacheConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from worker.models.default_model import resolve_model

    path = Path(config.model) if Path(config.model).exists() else resolve_model(config.model)
    executor_config = ExecutorConfig(
        max_batch_size=config.max_batch_size,
        max_num_tokens=config.max_num_tokens,
        max_beam_width=config.max_beam_width,
        kv_cache_config=KvCacheConfig(max_tokens=config.kv_tokens, dtype=config.kv_cache_dtype,
                                      host_cache_size=config.host_kv_cache_bytes),
        logits_post_processors=config.logits_post_processors,
        backend="auto" if config.backend == "echo" else config.backend,
        device=config.device,
        speculative_config=config.speculative_config,
        draft_model=None if config.backend == "echo" else config.draft_model,
        parallel_config=ParallelConfig(config.tensor_parallel_size, config.pipeline_parallel_size,
                                       expert_parallel=config.expert_parallel),
        quantization=config.quantization,
        lora_adapters=dict(config.lora_adapters),
        peft_cache_config=config.peft_cache_config,
        scheduler_config=SchedulerConfig(CapacitySchedulerPolicy(config.scheduler_policy)),
        deterministic=config.deterministic,
    )
    block = executor_config.kv_cache_config.tokens_per_block
    if config.kv_tokens is not None and config.kv_tokens < block:
        raise ValueError(f"kv_tokens {config.kv_tokens} is smaller than one KV block ({block} tokens): no request fits")
    if config.backend != "echo":
        return EngineCore.from_model(path, executor_config), path
    from worker.backends.echo_backend import EchoBackend
    from worker.models.loader import load_model

    log.warning("echo backend: TRANSPORT TEST ONLY, no model runs")
    meta = load_model(path, load_weights=False)  # config and tokenizer: gateways detokenize as usual
    core = EngineCore(EchoBackend(meta.config), executor_config, tokenizer=meta.tokenizer,
                      chat_template=meta.chat_template)
    return core, path


def _engine_main(config: EngineConfig, inbox: Connection, outbox: Connection, turned: ctypes.c_double,
                 worker: int) -> None:  # fmt: skip
    from ops.compute_threads import limit_compute_threads
    from ops.logs import setup_logging
    from ops.process import exit_on_thread_crash, follow_parent, settle_gc

    # The worker decides when this process stops (it drains first); a worker killed
    # outright takes the engine along, whatever the engine is doing.
    follow_parent(worker)
    setup_logging("worker", config.log_level, config.log_format)
    exit_on_thread_crash()
    try:
        core, path = build_core(config)
    except Exception as e:
        if not isinstance(e, ValueError | OSError):  # a bad path, checkpoint or setting says all in one line
            log.exception("the engine could not load %s", config.model)
        _send(outbox, ("failed", f"could not load {config.model}: {type(e).__name__}: {e}"))
        return
    compute_threads = limit_compute_threads(config.cpu_threads)
    tokenizer = core.tokenizer
    devices = cuda_devices(core)
    _send(outbox, ("ready", EngineInfo(
        model_path=path,
        backend=core.backend.name,
        num_blocks=core.blocks.num_blocks,
        max_batch_size=core.config.max_batch_size,
        vocab_size=core.model_config.vocab_size,
        max_seq_len=core.max_seq_len,
        tokenizer_json=None if tokenizer is None else tokenizer.to_str().encode(),
        iteration_stats_max=core.config.iteration_stats_max,
        quantization=getattr(core.backend, "quantization", None),
        kv_cache_dtype=core.config.kv_cache_config.dtype,
        chat_template=core.chat_template,
        bos_token=_token_text(tokenizer, core.model_config.bos_token_id),
        eos_token=_token_text(tokenizer, (core.model_config.eos_token_ids or (None,))[0]),
        lora_adapters=tuple(core.lora_names()),
        compute_threads=compute_threads,
        block_size=core.blocks.block_size,
        cuda_devices=devices,
        host_id=host_id() if devices else "",
    )))  # fmt: skip
    core.blocks.record_events()
    settle_gc()
    _serve(core, inbox, outbox, turned)


def _token_text(tokenizer: Any, token_id: int | None) -> str | None:
    return None if tokenizer is None or token_id is None else tokenizer.id_to_token(token_id)


def _serve(core: EngineCore, inbox: Connection, outbox: Connection, turned: ctypes.c_double) -> None:
    """The engine's loop, until the worker says stop: take what waits in the pipe
    (block only while the core is idle), step, send the step's output. Iteration
    stats cross in batches; an idle engine still reports its load now and then."""
    stats: list[ex.IterationStats] = []
    last_sent = last_stats = time.monotonic()
    kv = EngineKv(core)
    asked = _Asked(core, outbox, kv)
    while True:
        # A stalled core (requests wait, none fits, none in flight) waits here for the
        # worker's cancels and requests instead of stepping in a spin.
        timeout = (_STALLED_WAIT_S if core.stalled else 0.0 if core.has_work
                   else _READ_POLL_S if asked.reading else _IDLE_LOAD_S)
        while inbox.poll(timeout):
            kind, body = _receive(inbox)
            if kind == "stop":
                return
            asked.waiting.append((kind, body))
            timeout = 0.0
        asked.apply()
        now = time.monotonic()
        turned.value = now
        out = core.step() if core.has_work else StepOutput()
        stats += out.iteration_stats
        out.iteration_stats = []
        if now - last_stats >= _ITERATION_STATS_S:
            out.iteration_stats, stats, last_stats = stats, [], now
        exports = kv.exports(out)
        kv.expire()
        kv_events = core.blocks.take_events()
        if out or kv_events or exports or now - last_sent >= _IDLE_LOAD_S:
            _send(outbox, (out, core.load(), kv_events, exports))
            last_sent = now


class _Asked:
    """What the worker sent, applied to the core in the pipe's order. A LoRA load reads its
    adapter on a thread (a large one takes a second or more) while the core keeps stepping;
    what came after the load waits until it is registered, so a request sent after it can
    run under the new adapter."""

    def __init__(self, core: EngineCore, outbox: Connection, kv: EngineKv) -> None:
        self.core = core
        self.outbox = outbox
        self.kv = kv
        self.waiting: collections.deque[tuple[str, Any]] = collections.deque()
        self.reading: tuple[int, str, str, Future[LoraAdapter]] | None = None  # token, name, path, the read
        self._reader: ThreadPoolExecutor | None = None

    def apply(self) -> None:
        if self.reading is not None:
            if not self.reading[3].done():
                return
            token, name, path, read = self.reading
            self.reading = None
            _send(self.outbox, _lora_reply(self.core, token, "load", name,
                                           lambda: self.core.add_lora(name, path, read.result())))  # fmt: skip
        while self.waiting and self.reading is None:
            kind, body = self.waiting.popleft()
            if kind == "submit":
                requests, watched = body
                for exec_id, prompt, model, how in watched:
                    self.kv.watch(exec_id, prompt, model, how)
                self.core.add_requests(requests)
            elif kind == "cancel":
                self.core.abort(body)
            elif kind == "kv_import":
                _send(self.outbox, self.kv.import_(*body))
            elif kind == "kv_return":
                resend = self.kv.returned(*body)
                if resend is not None:
                    _send(self.outbox, resend)
            elif kind == "lora_load" and self.core.config.lora_enabled:
                token, name, path = body
                self._reader = self._reader or ThreadPoolExecutor(1, thread_name_prefix="lora-read")
                self.reading = (token, name, path, self._reader.submit(self.core.load_lora, path))
            elif kind == "lora_load":
                _send(self.outbox, _lora_reply(self.core, body[0], "load", body[1], lambda: None))
            else:  # lora_unload
                token, name = body
                _send(self.outbox, _lora_reply(self.core, token, "unload", name,
                                               functools.partial(self.core.unregister_lora, name)))  # fmt: skip


def _lora_reply(core: EngineCore, token: int, verb: str, name: str, change: Callable[[], None]) -> LoraReply:
    """Make a change to the adapters and say how it went: a bad adapter is an answer, not a failure."""
    if not core.config.lora_enabled:
        return LoraReply(token, (), "LoRA is off on this worker: start it with --lora NAME=DIR or --max-loras N")
    try:
        change()
    except Exception as e:  # whatever the adapter or the ask, the engine serves on
        if not isinstance(e, ValueError | OSError):
            log.exception("LoRA adapter %r: %s failed", name, verb)
        why = str(e) if isinstance(e, ValueError | OSError) else f"{type(e).__name__}: {e}"
        return LoraReply(token, tuple(core.lora_names()), f"cannot load LoRA adapter {name!r}: {why}"
                         if verb == "load" else why)  # fmt: skip
    log.info("LoRA adapter %r %sed", name, verb)
    return LoraReply(token, tuple(core.lora_names()))


def _send(outbox: Connection, message: object) -> None:
    outbox.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


def _receive(inbox: Connection) -> tuple[str, Any]:
    try:
        message: tuple[str, Any] = pickle.loads(inbox.recv_bytes())
    except (EOFError, OSError):
        # The worker process is gone (kill -9 leaves no time for "stop"): nobody
        # is left to serve, and the device must be freed now.
        log.warning("the worker process is gone: the engine exits")
        os._exit(1)
    return message
