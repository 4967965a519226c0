"""The ranks of a tensor- and pipeline-parallel model: one process per device, each
holding its part of the weights (its shard of its stage's layers) and of the KV cache.

Rank 0 is the process that runs the engine core (the worker's engine process, or an
in-process Executor); it starts ranks 1..N-1 itself. Its backend (DistributedBackend)
sends every call that runs the model to the other ranks over a pipe each, then runs
its own part: every rank runs the same packed batch, and the collectives inside the
forward (all-reduce, logits gather) and the stages' hand-offs meet. Rank 0 holds the
last pipeline stage (group.py) and alone samples; the ids it sampled are broadcast on
the devices, since the next step's placeholder tokens (overlap scheduling) stand for
them on the first stage. The other ranks hold no scheduler, no block manager and no
sockets.

The ranks live and die together: rank 0 exits when any other rank exits (a monitor
thread watching their sentinels), and the others get SIGKILL from the kernel when
rank 0 is gone (PR_SET_PDEATHSIG), since a rank blocked in an NCCL collective would
otherwise wait forever.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import pickle
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ops.process import follow_parent
from worker.backends.base import ForwardBatch, SampleOutput, SamplingBatch, StepHandle
from worker.backends.torch_backend import TorchBackend
from worker.executor.types import ParallelConfig
from worker.models.lora import LoraAdapter
from worker.parallel import layout
from worker.parallel.group import World, join, leave

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class RankSpec:
    """What every rank builds its backend from."""

    source: Path  # the checkpoint: each rank reads it and keeps its shard
    device_type: str  # "cuda" (rank r on the r-th visible GPU) or "cpu" (gloo)
    dtype: str | None
    max_num_tokens: int
    max_graph_batch: int
    max_batch_size: int  # rows one step may sample: the working memory each rank plans for
    tensor_parallel_size: int
    pipeline_parallel_size: int
    micro_batch_count: int  # 0: one per stage
    port: int  # where the ranks rendezvous, on 127.0.0.1
    quantize: str | None = None  # "fp8" | "int4": every rank quantizes its shard on load
    kv_cache_dtype: str | None = None  # "fp8": every rank's KV pool
    expert_parallel: bool = False  # MoE layers: whole experts per rank (expert_parallel.py)


class DistributedBackend:
    """Rank 0's backend (an AsyncBackend and a LoraBackend): each call that runs the
    model or writes its memory goes to the other ranks first, then to this rank's shard."""

    def __init__(self, inner: TorchBackend, world: World, links: list[Connection],
                 processes: Sequence[BaseProcess]) -> None:  # fmt: skip
        self.inner, self.world = inner, world
        self.name, self.config = inner.name, inner.config
        self.quantization = inner.quantization  # what the worker's Ready and logs name
        self.device, self.dtype = inner.device, inner.dtype
        self._links, self.processes = links, processes
        self._closing = threading.Event()
        threading.Thread(target=self._watch, name="rank-monitor", daemon=True).start()
        atexit.register(self.close)

    def kv_bytes_per_token(self) -> int:
        """The most any rank holds per token (pipeline stages may hold unequal numbers of
        layers): with free_memory_bytes, a block count every rank's memory takes."""
        self._send(("kv_bytes", None))
        return self.world.max_over_ranks(self.inner.kv_bytes_per_token())

    def free_memory_bytes(self) -> int:
        """The least any rank has: every rank holds the same number of KV blocks."""
        self._send(("free_memory", None))
        return self.world.min_over_ranks(self.inner.free_memory_bytes())

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._send(("allocate", (num_blocks, block_size)))
        self.inner.allocate_kv_cache(num_blocks, block_size)

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        self._send(("copy_blocks", (src, dst)))
        self.inner.copy_blocks(src, dst)

    def allocate_host_kv_cache(self, num_blocks: int) -> None:
        self._send(("allocate_host", num_blocks))
        self.inner.allocate_host_kv_cache(num_blocks)

    def offload_kv_blocks(self, device_blocks: np.ndarray, host_slots: np.ndarray) -> None:
        self._send(("offload", (device_blocks, host_slots)))
        self.inner.offload_kv_blocks(device_blocks, host_slots)

    def load_kv_blocks(self, host_slots: np.ndarray, device_blocks: np.ndarray) -> None:
        self._send(("load", (host_slots, device_blocks)))
        self.inner.load_kv_blocks(host_slots, device_blocks)

    def enable_lora(self, num_slots: int, max_rank: int) -> None:
        self._send(("enable_lora", (num_slots, max_rank)))
        self.inner.enable_lora(num_slots, max_rank)

    def load_lora_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        """The whole adapter to every rank (it is small): each writes its stage's layers'
        shard, after the steps sent before (the pipes keep the order)."""
        self._send(("load_lora_slot", (slot, adapter)))
        self.inner.load_lora_slot(slot, adapter)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self._send(("forward", (batch, 0)))
        return self.inner.forward(batch)

    def sample(self, logits: torch.Tensor, sampling: SamplingBatch) -> SampleOutput:
        out = self.inner.sample(logits, sampling)
        self._share_sampled(sampling.temperature.shape[0])
        return out

    def launch(self, batch: ForwardBatch, sampling: SamplingBatch | None) -> StepHandle:
        rows = 0 if sampling is None else int(sampling.temperature.shape[0])
        self._send(("forward", (batch, rows)))
        handle = self.inner.launch(batch, sampling)
        if rows:
            assert self.inner.last_ids is not None
            self.world.broadcast(self.inner.last_ids)
        return handle

    def logits_to_host(self, logits: torch.Tensor) -> np.ndarray:
        return self.inner.logits_to_host(logits)

    def _share_sampled(self, rows: int) -> None:
        self._send(("sampled", rows))
        assert self.inner.last_ids is not None
        self.world.broadcast(self.inner.last_ids)

    def close(self) -> None:
        """Stop the other ranks (at exit: a normal end is not a rank dying)."""
        if self._closing.is_set():
            return
        self._closing.set()
        for link in self._links:
            with contextlib.suppress(OSError):
                link.send_bytes(pickle.dumps(("stop", None)))
        # Every rank leaves the group at once (NCCL's teardown waits for the peers), and
        # after the graphs that captured its collectives are gone.
        self.inner.release_graphs()
        leave()
        for p in self.processes:
            p.join(10)
            if p.is_alive():
                p.kill()

    def _send(self, message: tuple[str, Any]) -> None:
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        for link in self._links:
            link.send_bytes(data)

    def _watch(self) -> None:
        """Ends this process when another rank exits: the model is gone with it."""
        ended = wait([p.sentinel for p in self.processes])
        if self._closing.is_set():
            return
        dead = [p for p in self.processes if p.sentinel in ended]
        log.critical("model rank %s exited with code %s: the engine ends", dead[0].name, dead[0].exitcode)
        for p in self.processes:
            if p.is_alive():
                p.kill()
        os._exit(1)


def start_ranks(model: Any, device: str | None, dtype: str | None, max_num_tokens: int, max_graph_batch: int,
                max_batch_size: int, parallel: ParallelConfig,
                kv_cache_dtype: str | None = None) -> DistributedBackend:  # fmt: skip
    """Start ranks 1..N-1 for a LoadedModel and build rank 0's backend in this process. The
    other ranks load the checkpoint themselves, with the quantization `model` was loaded with."""
    layout.validate(parallel, model.config)
    spec = RankSpec(
        source=Path(model.source),
        device_type=_device_type(device, parallel.world_size),
        dtype=dtype,
        max_num_tokens=max_num_tokens,
        max_graph_batch=max_graph_batch,
        max_batch_size=max_batch_size,
        tensor_parallel_size=parallel.tensor_parallel_size,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        micro_batch_count=parallel.micro_batches,
        port=_free_port(),
        quantize=getattr(model, "quantize", None),
        kv_cache_dtype=kv_cache_dtype,
        expert_parallel=parallel.expert_parallel,
    )
    links, processes = spawn_ranks(parallel.world_size, _follower_main, (spec,))
    world = _join(0, spec)
    backend = _rank_backend(model, spec, world)
    return DistributedBackend(backend, world, links, processes)


def spawn_ranks(
    size: int, target: Callable[..., None], args: tuple[Any, ...]
) -> tuple[list[Connection], list[BaseProcess]]:
    """Start ranks 1..size-1, each running target(rank, inbox, parent pid, *args) in a
    spawned process; returns rank 0's pipe to each, and the processes."""
    ctx = multiprocessing.get_context("spawn")  # CUDA does not survive fork
    links: list[Connection] = []
    processes: list[BaseProcess] = []
    for rank in range(1, size):
        inbox, outbox = ctx.Pipe(duplex=False)
        p = ctx.Process(target=target, args=(rank, inbox, os.getpid(), *args), name=f"tokenwire-rank{rank}",
                        daemon=True)  # fmt: skip
        p.start()
        inbox.close()  # the rank's end: its exit must read as end-of-file here
        links.append(outbox)
        processes.append(p)
    return links, processes


def _join(rank: int, spec: RankSpec) -> World:
    return join(rank, spec.tensor_parallel_size, spec.port, spec.device_type, spec.pipeline_parallel_size,
                spec.expert_parallel)  # fmt: skip


def _rank_backend(model: Any, spec: RankSpec, world: World) -> TorchBackend:
    return TorchBackend(
        model,
        dtype=spec.dtype,
        max_num_tokens=spec.max_num_tokens,
        max_graph_batch=spec.max_graph_batch,
        max_batch_size=spec.max_batch_size,
        world=world,
        micro_batch_count=spec.micro_batch_count,
        kv_cache_dtype=spec.kv_cache_dtype,
    )


def _device_type(device: str | None, size: int) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.index is not None:
        raise ValueError(
            f"device {device!r}: with tensor or pipeline parallelism rank r runs on the r-th visible GPU; "
            "choose the GPUs with CUDA_VISIBLE_DEVICES"
        )
    if dev.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"{size} ranks (tensor x pipeline parallel size) need {size} GPUs, "
                         f"{torch.cuda.device_count()} visible")  # fmt: skip
    return dev.type


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- ranks 1..N-1 ---------------------------------------------------------------------


def _follower_main(rank: int, inbox: Connection, parent: int, spec: RankSpec) -> None:
    follow_parent(parent)  # die with rank 0, which decides when to stop
    from worker.models.loader import load_model

    world = _join(rank, spec)
    # On CUDA the backend reads the safetensors straight to the device (tensor_refs).
    model = load_model(spec.source, load_weights=spec.device_type != "cuda", quantization=spec.quantize)
    backend = _rank_backend(model, spec, world)
    serve(backend, world, inbox)
    leave()


def serve(backend: TorchBackend, world: World, inbox: Connection) -> None:
    """Run what rank 0 runs, call by call, until it says stop or is gone; then drop the
    CUDA graphs, which hold collectives that would keep the group from tearing down."""
    while True:
        try:
            kind, body = pickle.loads(inbox.recv_bytes())
        except (EOFError, OSError):
            log.warning("model rank %d: rank 0 is gone", world.rank)
            break
        if kind == "forward":
            batch, rows = body
            backend.forward(batch)  # the logits are rank 0's to sample
            _receive_sampled(backend, world, rows)
        elif kind == "sampled":
            _receive_sampled(backend, world, body)
        elif kind == "kv_bytes":
            world.max_over_ranks(backend.kv_bytes_per_token())
        elif kind == "free_memory":
            world.min_over_ranks(backend.free_memory_bytes())
        elif kind == "allocate":
            backend.allocate_kv_cache(*body)
        elif kind == "copy_blocks":
            backend.copy_blocks(*body)
        elif kind == "allocate_host":
            backend.allocate_host_kv_cache(body)
        elif kind == "offload":
            backend.offload_kv_blocks(*body)
        elif kind == "load":
            backend.load_kv_blocks(*body)
        elif kind == "enable_lora":
            backend.enable_lora(*body)
        elif kind == "load_lora_slot":
            backend.load_lora_slot(*body)
        else:  # stop
            break
    backend.release_graphs()


def _receive_sampled(backend: TorchBackend, world: World, rows: int) -> None:
    if not rows:
        backend.last_ids = None
        return
    backend.last_ids = world.broadcast(torch.empty(rows, dtype=torch.int64, device=backend.device))

