"""The torch backend: the decoder (worker.models.llama) over a paged KV
cache, on CUDA or the CPU.

On CUDA: bf16 weights and KV cache, cuBLAS GEMMs over fused projections (qkv,
gate_up), Triton kernels for attention over the paged cache (prefill chunks and
generation alike) and for the fused elementwise stages (torch_decoder_ops.py), and
CUDA graphs for generation steps, speculative verification included (cuda_graphs.py). On the CPU (CI): the same
forward in float32 with plain torch ops.

Every step's integer metadata travels in one pinned int32 buffer and one
non-blocking host-to-device copy; only sampled token ids and log probs come back.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.backends import fp8_gemm, logits_argmax, paged_attention
from worker.backends.base import ForwardBatch, SampleOutput, SamplingBatch
from worker.backends.cuda_graphs import MAX_QUERY, DecodeGraphs
from worker.backends.memory_plan import WorkingMemory, gib, plan_working_memory
from worker.backends.quant_linear import Fp8Linear, QuantLinear
from worker.backends.torch_decoder_ops import TorchDecoderOps, TorchLinear
from worker.backends.torch_host_kv import TorchHostKv
from worker.backends.torch_sampler import sample_all, warm_up_batch
from worker.backends.torch_step import PinnedStaging, StepInputs
from worker.models import llama
from worker.models.config import CheckpointError, ModelConfig
from worker.models.lora import LoraAdapter
from worker.models.mxfp4 import Mxfp4Tensor
from worker.models.mxfp4_checkpoint import Mxfp4File
from worker.models.quantization import QuantizedWeight, check_mode
from worker.parallel import layout
from worker.parallel.group import World
from worker.parallel.pipeline import PipelineStage
from worker.parallel.sharded_ops import ShardedTorchDecoderOps

log = logging.getLogger(__name__)


def _dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        dtype = getattr(torch, name)
    except AttributeError:
        dtype = None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a torch floating-point dtype name such as 'bfloat16', got {name!r}")
    return dtype


class _Launched:
    """A step queued on the device; `result` waits for its token ids and log probs (and an
    MoE model's router statistics, read in the same wait)."""

    def __init__(self, tensors: list[torch.Tensor], event: torch.cuda.Event | None,
                 expert_tokens: bool = False) -> None:  # fmt: skip
        self.tensors, self.event = tensors, event  # ids, log probs[, top tokens, top log probs][, expert tokens]
        self.expert_tokens = expert_tokens

    def result(self) -> SampleOutput:
        if self.event is not None:
            self.event.synchronize()
        arrays = [t.numpy().copy() for t in self.tensors]
        experts = arrays.pop() if self.expert_tokens else None
        ids, lps, *top = arrays
        top_tokens, top_log_probs = top if top else (None, None)
        return SampleOutput(ids.astype(np.int64), lps, top_tokens, top_log_probs, experts)


class _NothingSampled:
    def result(self) -> None:
        return None


class TorchBackend:
    def __init__(
        self,
        model: Any,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        *,
        weights: Mapping[str, torch.Tensor | np.ndarray | QuantizedWeight | Mxfp4Tensor | Mxfp4File] | None = None,
        max_num_tokens: int = 8192,
        max_model_len: int | None = None,
        use_cuda_graphs: bool = True,
        max_graph_batch: int = 512,
        max_verify_graph_batch: int = 32,
        world: World | None = None,
        micro_batch_count: int = 0,
        quantization: str | None = None,
        kv_cache_dtype: str | None = None,
        max_batch_size: int | None = None,
        free_memory: int | None = None,
        deterministic: bool = False,
    ) -> None:
        """`model` is a LoadedModel (worker.models) or a ModelConfig with `weights`
        given separately (Hugging Face names; a fused `...qkv_proj.weight` /
        `...gate_up_proj.weight` is used as is, so callers can share memory).
        `quantization` ("fp8" | "int4") quantizes float linear weights as they are made
        (a LoadedModel's own `quantize` applies when it is not given). `kv_cache_dtype`
        "fp8" keeps K and V as float8 e4m3 (unscaled): twice the tokens in the same memory.
        With `world`, this rank holds and runs its part of the model (worker/parallel), on
        the world's device: its tensor-parallel shard of its pipeline stage's layers; a
        stage cuts each step into `micro_batch_count` micro-batches (0: one per stage) and
        runs without CUDA graphs. `max_batch_size` bounds the rows sampled
        in one step (default `max_graph_batch`); with `max_num_tokens` and the graphs it
        sizes the working memory kept out of the KV cache (memory_plan.py). `free_memory`:
        bytes to plan the KV cache with instead of what the device reports free now (a
        device shared with another process; tests). Speculative verification steps of
        up to `max_verify_graph_batch` sequences run in CUDA graphs too (cuda_graphs.py).
        `deterministic`: a request's logits do not depend on its batch-mates: linear layers
        and the lm head in fixed row tiles (invariant_matmul.py); on CUDA every step's
        attention in the prefill kernel's tiles, one program per tile (not the decode
        kernel whose split-KV count follows the batch size), and no CUDA graphs (their
        steps take the decode kernel)."""
        if world is not None:
            device = world.device
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = _dtype(dtype, self.device)
        self.on_cuda = self.device.type == "cuda"
        if deterministic and world is not None and world.tensor_parallel_size > 1:
            raise ValueError("deterministic mode runs on one GPU, not with tensor parallelism")
        self.deterministic = deterministic
        self.name = "torch-cuda" if self.on_cuda else "torch-cpu"
        if isinstance(model, ModelConfig) and weights is None:
            raise ValueError("TorchBackend(ModelConfig, ...) needs weights=")
        self.config: ModelConfig = model if isinstance(model, ModelConfig) else model.config
        self.max_num_tokens = max_num_tokens
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        # Before any weight is read: the ops refuse a model they cannot run.
        check_mode(quantization)
        quantize = quantization or getattr(model, "quantize", None)
        self.quantization: str | None = getattr(model, "quantization", None) if quantization is None else quantization
        if deterministic and self.quantization is not None:
            raise ValueError(f"deterministic mode runs float weights only, not {self.quantization}")
        if kv_cache_dtype not in (None, "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'fp8' or None, got {kv_cache_dtype!r}")
        kv_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else self.dtype
        # A pipeline stage: its layers, and the ranks before and after it.
        self.stage = (
            PipelineStage(world, self.config, self.dtype, micro_batch_count)
            if world is not None and world.pipeline_parallel_size > 1
            else None
        )
        ops_config = self.config if self.stage is None else layout.stage_config(self.config, self.stage.layers)
        self.ops = (
            TorchDecoderOps(ops_config, self.device, self.dtype, self.max_model_len, quantize=quantize,
                            kv_dtype=kv_dtype, deterministic=deterministic)
            if world is None or world.tensor_parallel_size == 1
            else ShardedTorchDecoderOps(ops_config, world.tensor, self.device, self.dtype, self.max_model_len,
                                        world.expert_parallel, quantize=quantize, kv_dtype=kv_dtype)
        )  # fmt: skip
        if weights is None:
            weights = _weights_of(model, self.device, self.dtype)
        self.model: llama.DecoderWeights[torch.Tensor, TorchLinear | QuantLinear] = llama.build_weights(
            self.config, weights, self.ops, None if self.stage is None else self.stage.layers
        )
        self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.on_cuda else 1
        self.block_size = 0
        self.host_kv: TorchHostKv | None = None  # the KV pool's host tier, when allocated
        self.scratch_slot = 0
        self.staging = PinnedStaging(self.device)
        self._graphs: DecodeGraphs | None = None
        # The MoE layers' expert loop reads its per-expert row counts on the host: no graph captures
        # it; the fused expert kernel reads nothing there.
        self._use_cuda_graphs = (use_cuda_graphs and self.on_cuda and self.stage is None and not deterministic
                                 and (not self.config.is_moe or self.ops.fused_experts))  # fmt: skip
        self._world = world  # tensor-parallel ranks agree on the decode graphs' timings
        self.lora_enabled = False  # LoRA slots allocated: decode graphs take each row's slot
        self._max_graph_batch = max_graph_batch
        self.max_batch_size = max_batch_size or max_graph_batch
        self._free_memory = free_memory
        self._max_verify_graph_batch = max_verify_graph_batch
        # Row count -> the FP8 GEMM timings that chose each projection's kernel (tune_gemms).
        self.fp8_gemm_timings: dict[int, list[fp8_gemm.Timing]] = {}
        # The previous launch's sampled ids, still on the device: the next step's
        # placeholder tokens (-(k + 1) for row k) are read from here. Tensor-parallel
        # ranks other than 0 receive them from rank 0 (worker/parallel/ranks.py).
        self.last_ids: torch.Tensor | None = None

    # -- construction from disk -------------------------------------------------------

    @classmethod
    def from_checkpoint(
        cls,
        directory: str | Path,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        **kwargs: Any,
    ) -> TorchBackend:
        """Read a Hugging Face checkpoint's safetensors straight onto the device."""
        from safetensors.torch import load_file

        directory = Path(directory)
        config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        weights: dict[str, torch.Tensor] = {}
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors weights")
        for file in files:
            weights.update(load_file(file, device=str(dev)))
        return cls(config, dev, dtype, weights=weights, **kwargs)

    # -- Backend protocol ----------------------------------------------------------------

    def kv_bytes_per_token(self) -> int:
        cfg = self.ops.config  # this rank's KV heads
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.ops.kv_dtype.itemsize

    def working_memory(self) -> WorkingMemory:
        """What one step may need beyond weights and KV cache, at this backend's limits."""
        return plan_working_memory(
            self.ops.config, self.config.vocab_size, self.dtype.itemsize, max_num_tokens=self.max_num_tokens,
            max_batch_size=self.max_batch_size, graph_batch=self._graph_rows(),
        )  # fmt: skip

    def _graph_rows(self) -> int:
        """The most logits rows one CUDA graph computes: a decode batch, or a verification
        graph's sequences times its query tokens (cuda_graphs.py); 0 without graphs."""
        if not self._use_cuda_graphs:
            return 0
        verify = min(self._max_verify_graph_batch, self._max_graph_batch) * MAX_QUERY
        return max(self._max_graph_batch, min(verify, self.max_num_tokens))

    def free_memory_bytes(self) -> int:
        if self._free_memory is not None:
            free = self._free_memory
        elif self.on_cuda:
            free, _total = torch.cuda.mem_get_info(self.device)
            # Blocks torch's caching allocator holds but no tensor uses are ours to reuse.
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        working = self.working_memory()
        log.info("%s: %s free after the weights; working memory %s (%s; max_num_tokens=%d, max_batch_size=%d, "
                 "graphs to %d); the rest, %s, is the KV cache's", self.name, gib(free), gib(working.total),
                 working.describe(), self.max_num_tokens, self.max_batch_size,
                 self._max_graph_batch if self._use_cuda_graphs else 0, gib(max(0, free - working.total)))
        return max(0, free - working.total)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._graphs = None
        # One extra block takes the writes of padded rows in CUDA-graph steps.
        self.ops.allocate_kv_cache(num_blocks + 1, block_size)
        self.block_size = block_size
        self.scratch_slot = num_blocks * block_size
        if self._use_cuda_graphs:
            max_blocks = -(-self.max_model_len // block_size)
            self._graphs = DecodeGraphs(self, self._max_graph_batch, max_blocks, block_size=block_size,
                                        max_verify_batch=self._max_verify_graph_batch,
                                        max_tokens=self.max_num_tokens)
        self.tune_gemms(self._graphs.buckets if self._graphs is not None else [], [self.max_num_tokens])
        if self._graphs is not None:
            # Every decode graph now, not on first use: no request waits on a capture, and the
            # graphs are timed so that a batch can run in a faster larger one (cuda_graphs.py).
            self._graphs.capture_all(self._world.broadcast if self._world is not None else None)
        if self.on_cuda:
            self.warm_up()

    def warm_up(self) -> None:
        """Run once what the decode graphs' capture did not (allocate_kv_cache does, on
        CUDA): the kernels of an eager prefill step, of eager decode steps at each attention
        split count the graphs do not cover (batches larger than the largest graph, or no
        graphs), and on CUDA each variant of the sampler's argmax and each of its rules
        (torch_sampler.warm_up_batch). Triton compiles and loads a kernel on its first
        launch, and on the H100 an 8B's first serving burst ran at 9,518 tok/s against
        21,376 while it did (logits_argmax.py). The dummy steps keep their K and V in the
        scratch block; every rank runs them at the same point of its start-up, as any step
        (a pipeline's stages pass their activations on)."""
        started = time.perf_counter()
        self.forward(self._scratch_batch(1, min(self.block_size, paged_attention.PREFILL_BLOCK_Q)))
        graphed = self._max_graph_batch if self._graphs is not None else 0
        first_of_splits: dict[int, int] = {}
        for seqs in range(graphed + 1, self.max_batch_size + 1):
            first_of_splits.setdefault(self.decode_splits(seqs), seqs)
        for seqs in first_of_splits.values():
            self.forward(self._scratch_batch(seqs, 1))
        if self.on_cuda:
            logits_argmax.load_kernels(self.device, self.config.vocab_size, self.max_num_tokens)
            logits = torch.zeros((2, self.config.vocab_size), dtype=torch.float32, device=self.device)
            self._sample_async(logits, warm_up_batch(self.config.vocab_size)).result()
            self.last_ids = None  # no step has sampled yet
            torch.cuda.synchronize(self.device)
        log.info("warm-up: an eager prefill step, %d eager decode steps and the sampler's kernels in %.1f s",
                 len(first_of_splits), time.perf_counter() - started)  # fmt: skip

    def _scratch_batch(self, seqs: int, tokens: int) -> ForwardBatch:
        """A step of `seqs` sequences of `tokens` tokens (at most a block), all in the scratch block."""
        scratch_block = self.scratch_slot // self.block_size
        offsets = np.tile(np.arange(tokens, dtype=np.int64), seqs)
        return ForwardBatch(
            token_ids=offsets.copy(), positions=offsets, slot_mapping=self.scratch_slot + offsets,
            query_start=np.arange(seqs + 1, dtype=np.int64) * tokens, context_lens=np.full(seqs, tokens, np.int64),
            block_tables=np.full((seqs, 1), scratch_block, np.int64),
            logits_indices=np.arange(1, seqs + 1, dtype=np.int64) * tokens - 1,
        )  # fmt: skip

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.ops.copy_blocks(src, dst)

    # -- the KV pool's host tier (HostKvBackend) ---------------------------------------------

    def allocate_host_kv_cache(self, num_blocks: int) -> None:
        self.host_kv = TorchHostKv(self.ops.k_cache, self.ops.v_cache, num_blocks)

    def offload_kv_blocks(self, device_blocks: np.ndarray, host_slots: np.ndarray) -> None:
        assert self.host_kv is not None, "allocate_host_kv_cache() must run first"
        with torch.inference_mode():
            self.host_kv.offload(device_blocks, host_slots)

    def load_kv_blocks(self, host_slots: np.ndarray, device_blocks: np.ndarray) -> None:
        assert self.host_kv is not None, "allocate_host_kv_cache() must run first"
        with torch.inference_mode():
            self.host_kv.load(host_slots, device_blocks)

    # -- LoRA (LoraBackend) ------------------------------------------------------------------

    def enable_lora(self, num_slots: int, max_rank: int) -> None:
        self.ops.allocate_lora(num_slots, max_rank)
        self.lora_enabled = True
        self._graphs = None  # graphs captured before had no LoRA ops; allocate_kv_cache makes new ones

    def load_lora_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        """A pipeline stage writes its layers' part; a tensor-parallel rank's ops cut their shard."""
        if adapter is not None and self.stage is not None:
            adapter = layout.stage_lora(adapter, self.stage.layers)
        with torch.inference_mode():
            self.ops.load_lora_slot(slot, adapter)

    def capture_verification_graphs(self, max_batch: int) -> None:
        """Capture the speculative-verification CUDA graphs of up to `max_batch`
        sequences now rather than on first use (benchmarks)."""
        if self._graphs is not None:
            self._graphs.capture_verification(max_batch)

    @property
    def graph_shapes(self) -> list[tuple[int, int]]:
        """The (batch bucket, query tokens per sequence) of every CUDA graph captured so far."""
        return [] if self._graphs is None else sorted(self._graphs.graphs)

    def release_graphs(self) -> None:
        """Drop the captured graphs (before a tensor-parallel group they captured
        collectives of is torn down); forward runs eagerly after this."""
        if self._graphs is not None:
            torch.cuda.synchronize(self.device)
            self._graphs = None
            self._use_cuda_graphs = False

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [S, vocab] float32 on the device. After a CUDA-graph step they live in
        the graph's output buffer: valid until the next forward (sample them first). A
        pipeline stage before the last returns an empty tensor (the logits are the last's)."""
        if not self.ops.k_cache:
            raise RuntimeError("allocate_kv_cache() must run before forward()")
        if self.host_kv is not None:
            self.host_kv.launching(batch.block_tables)
        with torch.inference_mode():
            if self.stage is not None:
                return self.stage.run(batch, self._upload, self.run_model)
            key = None if self._graphs is None else self._graphs.key(batch)
            if key is not None:
                assert self._graphs is not None
                return self._graphs.run(batch, key)
            return self.run_model(self._upload(batch))

    def hidden_states(self, batch: ForwardBatch) -> np.ndarray:
        """HiddenStateBackend: the final hidden state [S, hidden] of batch.logits_indices,
        float32 on the host. Eager (no CUDA graph holds this output), on the stream the
        steps run on, so it is ordered after any step in flight."""
        if not self.ops.k_cache:
            raise RuntimeError("allocate_kv_cache() must run before hidden_states()")
        if self.stage is not None:
            raise RuntimeError("hidden states are not available under pipeline parallelism")
        with torch.inference_mode():
            h = llama.forward(self.model, self.ops, self._upload(batch), hidden=True)
            return h.float().cpu().numpy()

    def sample(self, logits: torch.Tensor, sampling: SamplingBatch) -> SampleOutput:
        return self._sample_async(logits, sampling).result()

    def launch(self, batch: ForwardBatch, sampling: SamplingBatch | None) -> _Launched | _NothingSampled:
        """Queue forward + sample and return at once (AsyncBackend): the executor
        prepares the next step while this one runs."""
        logits = self.forward(batch)
        if sampling is None:
            self.last_ids = None
            return _NothingSampled()
        return self._sample_async(logits, sampling)

    def _sample_async(self, logits: torch.Tensor, sampling: SamplingBatch) -> _Launched:
        with torch.inference_mode():
            ids, log_probs, top = sample_all(logits, sampling)
            self.last_ids = ids
            tensors = [ids, log_probs, *(top or ())]
            # Router statistics: a snapshot of the layers' counters, copied back with the tokens.
            experts = self.config.is_moe and self.stage is None
            if experts:
                tensors.append(self.ops.expert_tokens.clone())
                self.ops.expert_tokens.zero_()
            if not self.on_cuda:
                return _Launched(tensors, None, experts)
            # Fresh pinned buffers per step: a step's results may be read after the next launch.
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(host, tensors, strict=True):
                h.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            return _Launched(host, event, experts)

    def resolve_pending(self, tokens: torch.Tensor, host_tokens: np.ndarray) -> None:
        """Replace placeholder ids -(k + 1) in `tokens` (on the device) by the previous
        launch's sampled row k, without a round trip to the host."""
        if not (host_tokens < 0).any():
            return
        if self.last_ids is None:
            raise RuntimeError("a placeholder token id, but the previous step sampled nothing")
        rows = (-tokens.long() - 1).clamp_(min=0)
        tokens.copy_(torch.where(tokens < 0, self.last_ids[rows].to(tokens.dtype), tokens))

    def logits_to_host(self, logits: torch.Tensor) -> np.ndarray:
        return logits.float().cpu().numpy()

    # -- one step ---------------------------------------------------------------------------

    def _upload(self, batch: ForwardBatch) -> StepInputs:
        """Pack the step's metadata into one pinned int32 buffer and copy it over once."""
        decode = batch.num_tokens == batch.num_seqs and not self.deterministic
        block_q = 1 if decode else paged_attention.PREFILL_BLOCK_Q
        tile_seq, tile_q0 = paged_attention.tile_map(batch.query_start, block_q)
        # The attention kernel takes the tables' width as their row stride, and Triton compiles
        # a kernel apart for a stride of 1, one of a multiple of 16 and any other: padded to a
        # multiple of 16, every step's tables take the kernel compiled at start-up.
        tables = batch.block_tables
        b, width = tables.shape
        if width == 0 or width % 16:
            tables = np.zeros((b, -(-max(width, 1) // 16) * 16), dtype=np.int64)
            tables[:, :width] = batch.block_tables
        parts = [
            batch.token_ids, batch.positions, batch.slot_mapping, batch.query_start, batch.context_lens,
            tables.reshape(-1), tile_seq, tile_q0, batch.logits_indices,
        ]  # fmt: skip
        sizes = [p.shape[0] for p in parts]
        # Each part starts 16-byte aligned: Triton specialises kernels on pointer alignment,
        # and unaligned views would recompile them for every new mix of batch sizes.
        starts = np.concatenate(([0], np.cumsum([-(-n // 4) * 4 for n in sizes])))
        host = self.staging.host(int(starts[-1]))
        flat = host.numpy()
        for part, start, n in zip(parts, starts, sizes, strict=False):
            flat[start : start + n] = part
        dev = self.staging.upload(host)
        t, b, s = batch.num_tokens, batch.num_seqs, batch.logits_indices.shape[0]
        views = [dev[start : start + n] for start, n in zip(starts, sizes, strict=False)]
        self.resolve_pending(views[0], batch.token_ids)
        lora_slots = lora_logits_slots = prompt_rows = prompt_embeds = None
        if batch.lora_slots is not None and self.lora_enabled:
            lora_slots = torch.from_numpy(batch.lora_slots).to(self.device, non_blocking=True)
            lora_logits_slots = lora_slots if s == t and s == b else lora_slots[views[8].long()]
        if batch.prompt_rows is not None:
            prompt_rows = torch.from_numpy(batch.prompt_rows).to(self.device)
            assert batch.prompt_embeds is not None
            prompt_embeds = torch.from_numpy(batch.prompt_embeds).to(self.device, self.dtype)
        return StepInputs(
            tokens=views[0],
            positions=views[1],
            slots=views[2],
            query_start=views[3],
            seq_lens=views[4],
            block_tables=views[5].view(b, -1),
            tile_seq=views[6],
            tile_q0=views[7],
            block_q=block_q,
            splits=self.decode_splits(b) if block_q == 1 else 1,
            logits_indices=None if (s == t and s == b) else views[8],
            query_start_host=batch.query_start,
            seq_lens_host=batch.context_lens,
            lora_slots=lora_slots,
            lora_logits_slots=lora_logits_slots,
            prompt_rows=prompt_rows,
            prompt_embeds=prompt_embeds,
        )

    def decode_splits(self, num_seqs: int) -> int:
        return paged_attention.decode_splits(num_seqs, self.ops.config.num_kv_heads, self._num_sms)

    def tune_gemms(self, graph_rows: list[int], eager_rows: list[int]) -> None:
        """cuBLAS or the Triton FP8 GEMM for each FP8 projection's shape, whichever was faster
        here (fp8_gemm.py): at the decode graphs' row counts for their products, and at
        `eager_rows` for eager ones (the full prefill chunk, max_num_tokens, which most prefill
        steps run). At start-up, so that no request waits on the timing or on Triton compiling."""
        linears = [linear for layer in self.model.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
                   if isinstance(linear, Fp8Linear)]  # fmt: skip
        if not linears:
            return
        for row_counts, graphed in ((graph_rows, True), (eager_rows, False)):
            for rows in row_counts:
                if rows < fp8_gemm.MIN_ROWS:
                    continue
                kept = {(t.out_features, t.in_features): t.kept for t in self._fp8_gemm_timing(rows, linears)}
                for linear in linears:
                    tile = kept.get((linear.weight.shape[0], linear.weight.shape[1]))
                    if tile is not None:
                        (linear.graph_tiles if graphed else linear.eager_tiles)[rows] = tile

    def _fp8_gemm_timing(self, rows: int, linears: list[Fp8Linear]) -> list[fp8_gemm.Timing]:
        if rows not in self.fp8_gemm_timings:
            timings = fp8_gemm.tune(rows, [(linear.weight, linear.scale) for linear in linears], self.dtype)
            self.fp8_gemm_timings[rows] = timings
            log.info("FP8 GEMMs at %d rows (out x in: cuBLAS / best Triton us): %s", rows, fp8_gemm.describe(timings))
        return self.fp8_gemm_timings[rows]

    def run_model(self, inp: StepInputs, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder over one packed step; returns float32 logits for the sampled rows,
        in `logits_out` when the lm head can write them there."""
        self.ops.logits_out = logits_out
        try:
            return llama.forward(self.model, self.ops, inp, self.stage)
        finally:
            self.ops.logits_out = None


def _weights_of(
    model: Any, device: torch.device, dtype: torch.dtype
) -> Mapping[str, torch.Tensor | np.ndarray | QuantizedWeight | Mxfp4File]:
    """A LoadedModel's tensors: read from disk onto the device when their files are known
    (no float32 detour for big checkpoints), else its float32 arrays; and its quantized
    linear weights and packed MXFP4 experts, as the loader holds them."""
    refs = getattr(model, "tensor_refs", None) or {}
    quantized = {**(getattr(model, "quantized", None) or {}), **(getattr(model, "mxfp4_experts", None) or {})}
    if not refs or (model.weights and device.type != "cuda"):
        return {**model.weights, **quantized}
    return _DeviceTensors({name: Path(ref.file) for name, ref in refs.items()}, device, dtype, quantized)


class _DeviceTensors(Mapping[str, torch.Tensor | QuantizedWeight | Mxfp4File]):
    """Safetensors read onto the device one tensor at a time, as the model's weights are
    built: a tensor-parallel rank keeps only its shard of each, so the whole checkpoint
    is never on its GPU at once. The loader's quantized linear weights and packed MXFP4 experts
    come as they are."""

    def __init__(self, files: dict[str, Path], device: torch.device, dtype: torch.dtype,
                 quantized: dict[str, QuantizedWeight | Mxfp4File]) -> None:  # fmt: skip
        self.files, self.device, self.dtype, self.quantized = files, device, dtype, quantized

    def __getitem__(self, name: str) -> torch.Tensor | QuantizedWeight | Mxfp4File:
        from safetensors import safe_open

        if name in self.quantized:
            return self.quantized[name]
        with safe_open(str(self.files[name]), framework="pt", device=str(self.device)) as f:
            return f.get_tensor(name).to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter({**self.files, **self.quantized})

    def __len__(self) -> int:
        return len({**self.files, **self.quantized})
