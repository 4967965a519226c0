"""CUDA graphs for generation steps: one new token per sequence (decode), or a few
(speculative verification: the last token and its drafts).

A generation step is ~10 kernels per layer on tiny activations, so without a graph
the GPU waits on Python launching them. A graph is keyed by (batch bucket, q): b
sequences of q query tokens each, over static input buffers: every decode graph is
captured with the KV cache (`capture_all`), a verification graph the first time a step
of its shape arrives. A step of n sequences whose longest has q
tokens runs graph (smallest bucket >= n, q):
- extra sequences are padded (no KV history, writes going to the backend's
  scratch slot);
- a sequence with fewer than q tokens gets padded query tokens after its own,
  which write to the scratch slot, and a KV length raised by as many: the paged
  attention kernel takes a sequence's queries as the last q of its KV length, so
  its real queries keep their positions and, causally, see only real keys; the
  padded queries' rows are never read.
The graph computes logits for all b * q rows; the step's wanted rows are gathered
from them. Verification graphs exist for q in 2 .. MAX_QUERY and batches up to
`max_verify_batch`, so at most len(buckets) * (MAX_QUERY - 1) of them. All graphs
share one memory pool: they never run at the same time. They also share one float32
logits buffer, each writing its rows there: a step's logits are read before the next
step runs, and a buffer per graph would hold every graph's rows at once (about 9,400
rows, 4.8 GB, for decode buckets to 1024 at a 128k vocabulary). With LoRA on, each
graph also reads a static per-token adapter slot buffer (-1 for padded tokens).

A larger decode graph can be the faster one: cuBLAS picks its kernels per row count, and
some counts get poor ones (on an H100, the 8B's bf16 gate_up takes 288 us at 448 rows and
157 at 512). So when every decode graph is captured at start-up (`capture_all`), each is
timed, and a batch goes to the fastest graph at or above its bucket where that one takes
at most ROUTE_MARGIN of the bucket's own time (`fastest_buckets`); padded rows cost the
GEMMs' extra rows only (their attention reads no key).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from worker.backends.base import ForwardBatch
from worker.backends.torch_step import PinnedStaging, StepInputs

log = logging.getLogger(__name__)

# Query tokens per sequence a verification graph takes: the last token and up to 8 drafts.
MAX_QUERY = 9
# A larger decode graph takes a batch only when it is at least 5 % faster than the batch's own
# bucket: a near tie keeps the smaller graph, so the routes do not flip between starts.
ROUTE_MARGIN = 0.95
# Replays timed per graph (the fastest counts).
TIMED_REPLAYS = 3


class GraphedBackend(Protocol):
    """What the graphs need of the torch backend (TorchBackend is one)."""

    device: torch.device
    staging: PinnedStaging
    scratch_slot: int  # the KV slot that padded rows write to
    lora_enabled: bool  # graphs run each row's LoRA adapter (slot -1: none, and for padded rows)

    def run_model(self, inp: StepInputs, logits_out: torch.Tensor | None = None) -> torch.Tensor: ...

    def resolve_pending(self, tokens: torch.Tensor, host_tokens: np.ndarray) -> None: ...

    def decode_splits(self, num_seqs: int) -> int: ...


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, of 32 to 256, of 64 beyond."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(96, 257, 32), *range(320, max_batch + 64, 64)]
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def replay_microseconds(graph: torch.cuda.CUDAGraph) -> float:
    """The fastest of TIMED_REPLAYS replays of a captured graph, after one untimed."""
    graph.replay()
    best = float("inf")
    for _ in range(TIMED_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3)
    return best


def fastest_buckets(micros: dict[int, float], margin: float = ROUTE_MARGIN) -> dict[int, int]:
    """Bucket -> the graph that runs its batches: the fastest bucket at or above it by the
    measured replay times, where that takes at most `margin` of the bucket's own time."""
    sizes = sorted(micros)
    routes = {}
    for i, b in enumerate(sizes):
        best = min(sizes[i:], key=lambda s: (micros[s], s))
        routes[b] = best if micros[best] <= margin * micros[b] else b
    return routes


def query_width(batch: ForwardBatch) -> int:
    """The most new tokens any sequence of the step has."""
    return int(np.diff(batch.query_start).max()) if batch.num_seqs else 0


def layout(batch: ForwardBatch, b: int, q: int, scratch_slot: int, meta: np.ndarray,
           lora: np.ndarray | None = None) -> np.ndarray | None:  # fmt: skip
    """Write the step into `meta` ([3 * b * q + b]: tokens | positions | slots | KV
    lengths) laid out as b sequences of q query tokens each (see the module doc), and
    each token's LoRA slot into `lora` [b * q] when given. Returns the graph's row of
    each wanted logits row (batch.logits_indices), or None when they are its first
    rows in order."""
    n, t = batch.num_seqs, batch.num_tokens
    bq = b * q
    tokens, positions, slots, seq_lens = meta[:bq], meta[bq : 2 * bq], meta[2 * bq : 3 * bq], meta[3 * bq :]
    wanted = batch.logits_indices
    if t == n * q:  # every sequence has q tokens: the packed order is the graph's
        tokens[:t] = batch.token_ids
        positions[:t] = batch.positions
        slots[:t] = batch.slot_mapping
        seq_lens[:n] = batch.context_lens
        if lora is not None:
            lora[:t] = -1 if batch.lora_slots is None else batch.lora_slots
            lora[t:] = -1
        tokens[t:] = 0
        positions[t:] = 0
        slots[t:] = scratch_slot
        in_order = wanted.shape[0] <= t and np.array_equal(wanted, np.arange(wanted.shape[0]))
        rows = None if in_order else wanted
    else:
        counts = np.diff(batch.query_start)
        seq_of = np.repeat(np.arange(n), counts)
        where = seq_of * q + (np.arange(t) - batch.query_start[:-1][seq_of])
        tokens[:] = 0
        positions[:] = 0
        slots[:] = scratch_slot
        tokens[where] = batch.token_ids
        positions[where] = batch.positions
        slots[where] = batch.slot_mapping
        if lora is not None:
            lora[:] = -1
            if batch.lora_slots is not None:
                lora[where] = batch.lora_slots
        seq_lens[:n] = batch.context_lens + (q - counts)
        rows = where[wanted]
    seq_lens[n:] = 0
    return rows


def graph_inputs(
    meta: torch.Tensor,
    block_tables: torch.Tensor,
    b: int,
    q: int,
    splits: int,
    seq_lens_host: np.ndarray | None = None,
    lora_slots: torch.Tensor | None = None,
) -> StepInputs:
    """StepInputs over a (b, q) layout's device buffers. `seq_lens_host`: the KV
    lengths for the CPU attention path (CUDA reads them from `meta`). The graph computes
    logits for every token, so the logits rows' LoRA slots are the tokens'."""
    bq = b * q
    device = meta.device
    return StepInputs(
        tokens=meta[:bq],
        positions=meta[bq : 2 * bq],
        slots=meta[2 * bq : 3 * bq],
        query_start=torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=device),
        seq_lens=meta[3 * bq :],
        block_tables=block_tables,
        tile_seq=torch.arange(b, dtype=torch.int32, device=device),
        tile_q0=torch.zeros(b, dtype=torch.int32, device=device),
        block_q=q,
        splits=splits,
        logits_indices=None,
        query_start_host=np.arange(0, (b + 1) * q, q),
        seq_lens_host=np.zeros(b, dtype=np.int64) if seq_lens_host is None else seq_lens_host,
        lora_slots=lora_slots,
        lora_logits_slots=lora_slots,
    )


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    meta: torch.Tensor  # int32 [3 * b * q + b]: tokens | positions | slots | seq_lens
    block_tables: torch.Tensor  # int32 [b, table width]
    logits: torch.Tensor  # float32 [b * q, vocab], rows of the shared buffer, written by each replay
    inputs: StepInputs  # holds the static tensors the graph reads (query starts, tile maps)
    lora_slots: torch.Tensor | None  # int64 [b * q] each token's LoRA slot, with LoRA on


class DecodeGraphs:
    def __init__(self, backend: GraphedBackend, max_batch: int, max_blocks: int, *, max_verify_batch: int = 0,
                 max_tokens: int = 0, block_size: int = 1) -> None:  # fmt: skip
        """Decode graphs up to `max_batch` sequences; verification graphs (q > 1) up to
        `max_verify_batch` sequences and `max_tokens` tokens (the forward's activation
        budget). Tables get room for the KV lengths raised by padding."""
        self.backend = backend
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.max_verify_batch = min(max_verify_batch, max_batch)
        self.max_tokens = max_tokens
        self.table_width = max_blocks + -(-(MAX_QUERY - 1) // block_size)
        self.device = backend.device
        self.pool: Any = None  # made at the first capture: torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Graph] = {}
        # [max(max_batch, bucket(max_verify_batch) * MAX_QUERY), vocab], made at the first capture
        self.logits: torch.Tensor | None = None
        # One stream for every warm-up (made at the first): the allocator caches freed blocks
        # per stream, so a new stream per capture would keep each warm-up's activations reserved.
        self.side: torch.cuda.Stream | None = None
        # Each decode graph's replay time (us) and the graph each bucket's batches run, once
        # capture_all has timed them (until then every batch runs its own bucket).
        self.decode_micros: dict[int, float] = {}
        self.routes: dict[int, int] = {}

    def bucket(self, b: int) -> int:
        return next(s for s in self.buckets if s >= b)

    def decode_bucket(self, n: int) -> int:
        """The decode graph that runs a step of n sequences."""
        b = self.bucket(n)
        return self.routes.get(b, b)

    def key(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """The graph (bucket, q) that runs this step, or None: eager."""
        n = batch.num_seqs
        if n == 0 or batch.block_tables.shape[1] > self.max_blocks or batch.prompt_rows is not None:
            return None  # (given embeddings, prompt tuning, run eagerly)
        if batch.num_tokens == n:
            if n <= self.max_batch and batch.logits_indices.shape[0] == n:
                return self.decode_bucket(n), 1
            return None
        if n > self.max_verify_batch:
            return None
        q = query_width(batch)
        b = self.bucket(n)
        if q > MAX_QUERY or b * q > self.max_tokens:
            return None
        return b, q

    def fits(self, batch: ForwardBatch) -> bool:
        return self.key(batch) is not None

    def capture_all(self, agree: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Capture every decode bucket now (largest first), rather than on first use, then
        time them and route each bucket's batches to the fastest graph (module doc);
        verification graphs are captured as their shapes arrive. `agree`: makes every
        tensor-parallel rank take the same timings (rank 0's), so that all run one graph."""
        if self.routes:
            return
        with torch.inference_mode():
            for b in reversed(self.buckets):
                self._get(b, 1)
            # Each graph as captured: every row padded, so its GEMMs, norms and head, no attention.
            micros = torch.tensor([replay_microseconds(self.graphs[b, 1].graph) for b in self.buckets],
                                  dtype=torch.float64)  # fmt: skip
        if agree is not None:
            micros = agree(micros.to(self.device)).cpu()
        self.decode_micros = dict(zip(self.buckets, micros.tolist(), strict=True))
        self.routes = fastest_buckets(self.decode_micros)
        log.info("%s", self.describe())

    def describe(self) -> str:
        """The decode graphs' replay times and the buckets that run in a larger graph: one line."""
        moved = ", ".join(f"{b} -> {r} ({self.decode_micros[b]:.0f} -> {self.decode_micros[r]:.0f} us)"
                          for b, r in self.routes.items() if r != b)  # fmt: skip
        times = ", ".join(f"{b}: {t:.0f}" for b, t in self.decode_micros.items())
        return f"decode graphs (rows: us a replay): {times}; run in a larger graph: {moved or 'none'}"

    def capture_verification(self, max_batch: int) -> None:
        """Capture now every verification graph a step of up to `max_batch` sequences may use."""
        if self.max_verify_batch < 1:
            return
        largest = self.bucket(min(max_batch, self.max_verify_batch))
        with torch.inference_mode():
            for b in reversed([s for s in self.buckets if s <= largest]):
                for q in range(2, MAX_QUERY + 1):
                    if b * q <= self.max_tokens:
                        self._get(b, q)

    def run(self, batch: ForwardBatch, key: tuple[int, int] | None = None) -> torch.Tensor:
        """Replay the graph of `key` (self.key(batch), which the caller may have found already)."""
        key = key or self.key(batch)
        assert key is not None, "run() on a step that fits() no graph"
        b, q = key
        g = self._get(b, q)
        n = batch.num_seqs
        width = batch.block_tables.shape[1]
        bq = b * q
        # One pinned staging area, one host-to-device copy, then device-side scatters.
        staging = self.backend.staging
        num_wanted = batch.logits_indices.shape[0]
        # meta | block tables | LoRA slots (with LoRA on) | wanted rows (when reordered)
        tables_end = 3 * bq + b + n * width
        lora_end = tables_end + (bq if g.lora_slots is not None else 0)
        host_t = staging.host(lora_end + num_wanted)
        host = host_t.numpy()
        lora = host[tables_end:lora_end] if g.lora_slots is not None else None
        rows = layout(batch, b, q, self.backend.scratch_slot, host[: 3 * bq + b], lora)
        host[3 * bq + b : tables_end] = batch.block_tables.reshape(-1)
        if rows is not None:
            host[lora_end:] = rows
        staged = staging.upload(host_t)
        g.meta.copy_(staged[: 3 * bq + b])
        self.backend.resolve_pending(g.meta[:bq], host[:bq])
        g.block_tables[:n, :width].copy_(staged[3 * bq + b : tables_end].view(n, width))
        if g.lora_slots is not None:
            g.lora_slots.copy_(staged[tables_end:lora_end])
        g.graph.replay()
        if rows is None:
            return g.logits[:num_wanted]
        return g.logits.index_select(0, staged[lora_end:])

    def _get(self, b: int, q: int) -> _Graph:
        found = self.graphs.get((b, q))
        if found is not None:
            return found
        meta = torch.zeros(3 * b * q + b, dtype=torch.int32, device=self.device)
        meta[2 * b * q : 3 * b * q] = self.backend.scratch_slot
        block_tables = torch.zeros((b, self.table_width), dtype=torch.int32, device=self.device)
        lora_slots = None
        if self.backend.lora_enabled:
            lora_slots = torch.full((b * q,), -1, dtype=torch.int64, device=self.device)
        inputs = graph_inputs(meta, block_tables, b, q, self.backend.decode_splits(b), lora_slots=lora_slots)
        # Warm up off the capture: Triton compiles and cuBLAS picks its kernels here.
        if self.side is None:
            self.side = torch.cuda.Stream(self.device)
        side = self.side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            warm = self.backend.run_model(inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.logits is None:
            verify_rows = self.bucket(self.max_verify_batch) * MAX_QUERY if self.max_verify_batch > 0 else 0
            rows = max(self.max_batch, verify_rows)
            self.logits = torch.empty((rows, warm.shape[1]), dtype=warm.dtype, device=self.device)
        del warm
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        logits = self.logits[: b * q]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.backend.run_model(inputs, logits)
            if out.data_ptr() != logits.data_ptr():  # (else the lm head wrote there itself)
                logits.copy_(out)  # the graph's own logits go back to the pool for the next capture
        self.graphs[b, q] = _Graph(graph, meta, block_tables, logits, inputs, lora_slots)
        return self.graphs[b, q]
