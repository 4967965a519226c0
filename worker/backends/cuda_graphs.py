"""CUDA graphs for generation-only steps (one new token per sequence).

A generation step is ~10 kernels per layer on tiny activations, so without a graph
the GPU waits on Python launching them. Each batch-size bucket gets one graph,
captured the first time a step of that size arrives, over static input buffers;
a step of B sequences runs the smallest bucket >= B, its extra rows padded (no
KV history, writes going to the backend's scratch slot). All graphs share one
memory pool: they never run at the same time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from worker.backends.base import ForwardBatch
from worker.backends.torch_step import PinnedStaging, StepInputs


class GraphedBackend(Protocol):
    """What the graphs need of the torch backend (TorchBackend is one)."""

    device: torch.device
    staging: PinnedStaging
    scratch_slot: int  # the KV slot that padded rows write to
    lora_enabled: bool  # graphs run each row's LoRA adapter (slot -1: none, and for padded rows)

    def run_model(self, inp: StepInputs) -> torch.Tensor: ...

    def resolve_pending(self, tokens: torch.Tensor, host_tokens: np.ndarray) -> None: ...

    def decode_splits(self, num_seqs: int) -> int: ...


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, of 32 to 256, of 64 beyond."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(96, 257, 32), *range(320, max_batch + 64, 64)]
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    meta: torch.Tensor  # int32 [4 * b]: tokens | positions | slots | seq_lens
    block_tables: torch.Tensor  # int32 [b, max_blocks]
    logits: torch.Tensor  # float32 [b, vocab], written by each replay
    lora_slots: torch.Tensor | None  # int64 [b] each row's LoRA slot, with LoRA on


class DecodeGraphs:
    def __init__(self, backend: GraphedBackend, max_batch: int, max_blocks: int) -> None:
        self.backend = backend
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.device = backend.device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, _Graph] = {}
        self.arange = torch.arange(max_batch + 1, dtype=torch.int32, device=self.device)
        self.zeros = torch.zeros(max_batch, dtype=torch.int32, device=self.device)

    def fits(self, batch: ForwardBatch) -> bool:
        b = batch.num_seqs
        return (
            batch.num_tokens == b
            and batch.logits_indices.shape[0] == b
            and b <= self.max_batch
            and batch.block_tables.shape[1] <= self.max_blocks
            and batch.prompt_rows is None  # given embeddings run eagerly
        )

    def bucket(self, b: int) -> int:
        return next(s for s in self.buckets if s >= b)

    def capture_all(self) -> None:
        """Capture every bucket now (largest first), rather than on first use."""
        with torch.inference_mode():
            for b in reversed(self.buckets):
                self._get(b)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        n = batch.num_seqs
        b = self.bucket(n)
        g = self._get(b)
        width = batch.block_tables.shape[1]
        # One pinned staging area, one host-to-device copy, then two device-side scatters.
        staging = self.backend.staging
        lora = b if g.lora_slots is not None else 0
        host_t = staging.host(4 * b + n * width + lora)
        host = host_t.numpy()
        meta = host[: 4 * b].reshape(4, b)
        meta[0, :n] = batch.token_ids
        meta[1, :n] = batch.positions
        meta[2, :n] = batch.slot_mapping
        meta[3, :n] = batch.context_lens
        meta[0:2, n:] = 0
        meta[2, n:] = self.backend.scratch_slot
        meta[3, n:] = 0
        host[4 * b : 4 * b + n * width] = batch.block_tables.reshape(-1)
        if g.lora_slots is not None:  # after the block tables; padded rows run no adapter
            host[4 * b + n * width :] = -1
            if batch.lora_slots is not None:
                host[4 * b + n * width : 4 * b + n * width + n] = batch.lora_slots
        staged = staging.upload(host_t)
        g.meta.copy_(staged[: 4 * b])
        self.backend.resolve_pending(g.meta[:n], batch.token_ids)
        g.block_tables[:n, :width].copy_(staged[4 * b : 4 * b + n * width].view(n, width))
        if g.lora_slots is not None:
            g.lora_slots.copy_(staged[4 * b + n * width :])
        g.graph.replay()
        return g.logits[:n]

    def _inputs(self, meta: torch.Tensor, block_tables: torch.Tensor, b: int,
                lora_slots: torch.Tensor | None) -> StepInputs:
        return StepInputs(
            tokens=meta[:b],
            positions=meta[b : 2 * b],
            slots=meta[2 * b : 3 * b],
            query_start=self.arange[: b + 1],
            seq_lens=meta[3 * b :],
            block_tables=block_tables,
            tile_seq=self.arange[:b],
            tile_q0=self.zeros[:b],
            block_q=1,
            splits=self.backend.decode_splits(b),
            logits_indices=None,
            query_start_host=np.arange(b + 1),
            seq_lens_host=np.zeros(b, dtype=np.int64),
            lora_slots=lora_slots,
            lora_logits_slots=lora_slots,
        )

    def _get(self, b: int) -> _Graph:
        found = self.graphs.get(b)
        if found is not None:
            return found
        meta = torch.zeros(4 * b, dtype=torch.int32, device=self.device)
        meta[2 * b : 3 * b] = self.backend.scratch_slot
        block_tables = torch.zeros((b, self.max_blocks), dtype=torch.int32, device=self.device)
        lora_slots = torch.full((b,), -1, dtype=torch.int64, device=self.device) if self.backend.lora_enabled else None
        inputs = self._inputs(meta, block_tables, b, lora_slots)
        # Warm up off the capture: Triton compiles and cuBLAS picks its kernels here.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.backend.run_model(inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.backend.run_model(inputs)
        self.graphs[b] = _Graph(graph, meta, block_tables, logits, lora_slots)
        return self.graphs[b]
