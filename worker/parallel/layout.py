"""Which slice of each weight a rank holds: its pipeline stage's layers, and its
tensor-parallel shard of them (Megatron-LM's layout).

Pipeline stages hold contiguous runs of layers, as even as the count allows (the first
stages take one more when it does not divide): stage 0 also holds the embedding, the
last stage the final norm and the lm head.

Column-parallel qkv and gate_up: each rank holds its heads' rows of q, k and v (and
its share of gate's and up's rows), so attention and SiLU * up run on local data.
Row-parallel o and down: the matching input columns, and the partial outputs are
summed across ranks. Vocabulary-parallel embedding and lm head: a contiguous range of
token rows, padded so every rank's range has the same length (the gather of the
logits needs equal parts). With fewer KV heads than ranks, each KV head is held by
the tp / kv_heads ranks whose query heads use it. Mixture-of-experts layers shard each
expert as a dense MLP (gate and up rows, down columns, summed after the layer) and keep
the router whole, so every rank routes alike; with expert parallelism each rank holds
whole experts instead (expert_parallel.py).

The slices are taken from the float tensors before the backend turns them into its
weights, so any linear-weight format (quantized included) shards the same way.

A LoRA adapter follows its projection: on qkv and gate_up A [r, in] is whole and B's
output rows are cut as the base weight's are; on o and down A's input columns are cut
and B is whole, so each rank's delta is a partial sum, added to the projection's own
before the one all-reduce (sharded_ops.py). A pipeline stage keeps its layers' weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from worker.models.config import ModelConfig
from worker.models.llama import LinearRole
from worker.models.lora import LoraAdapter, LoraWeights
from worker.models.moe_checkpoint import ExpertTensors
from worker.models.mxfp4 import BLOCK as MXFP4_BLOCK
from worker.models.mxfp4 import Mxfp4Tensor
from worker.parallel import expert_parallel

if TYPE_CHECKING:
    from worker.executor.types import ParallelConfig

# The projections cut along their input: each rank's output is a partial sum.
ROW_PARALLEL: tuple[LinearRole, ...] = ("o", "down")


def validate(parallel: ParallelConfig, config: ModelConfig) -> None:
    """Raise ValueError when the model cannot be split this way."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError(f"parallel sizes must be >= 1, got tensor {tp}, pipeline {pp}")
    if parallel.micro_batches < 0:
        raise ValueError(f"micro_batches must be >= 0 (0: one per pipeline stage), got {parallel.micro_batches}")
    if pp > config.num_layers:
        raise ValueError(f"{config.num_layers} layers do not split over {pp} pipeline stages (at most one per layer)")
    if config.num_heads % tp:
        raise ValueError(f"{config.num_heads} attention heads do not split over {tp} tensor-parallel ranks")
    kv = config.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(f"{kv} KV heads neither split over nor replicate onto {tp} tensor-parallel ranks")
    if parallel.expert_parallel:
        expert_parallel.validate(config, tp)
    elif config.moe_intermediate_size % tp:
        raise ValueError(f"expert intermediate size {config.moe_intermediate_size} does not split over {tp} ranks")
    if config.intermediate_size % tp:
        raise ValueError(f"intermediate size {config.intermediate_size} does not split over {tp} ranks")


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The layers pipeline stage `stage` of `pp` holds."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def stage_config(config: ModelConfig, layers: range) -> ModelConfig:
    """The model as a stage's ops see it: its layers (its KV pool holds only theirs)."""
    return config if len(layers) == config.num_layers else replace(config, num_layers=len(layers))


def local_config(config: ModelConfig, tp: int, whole_experts: bool = False) -> ModelConfig:
    """The model as one rank's ops see it: its heads, KV heads and MLP width (the experts'
    whole under expert parallelism)."""
    return replace(
        config,
        num_heads=config.num_heads // tp,
        num_kv_heads=max(1, config.num_kv_heads // tp),
        intermediate_size=config.intermediate_size // tp,
        moe_intermediate_size=config.moe_intermediate_size // (1 if whole_experts else tp),
    )


def vocab_shard(vocab_size: int, rank: int, tp: int) -> tuple[int, int]:
    """(first token, rows) of the rank's vocabulary range; the last range is padded."""
    rows = -(-vocab_size // tp)
    return rank * rows, rows


def shard_vocab(table: Any, rank: int, tp: int) -> Any:
    """The rank's rows of an embedding or lm head [vocab, hidden], zero-padded."""
    vocab = table.shape[0]
    start, rows = vocab_shard(vocab, rank, tp)
    part = table[start : min(start + rows, vocab)]
    if part.shape[0] == rows:  # a copy: a view would keep the whole table alive
        return part.copy() if isinstance(part, np.ndarray) else part.clone()
    pad = (rows - part.shape[0], *part.shape[1:])
    if isinstance(part, np.ndarray):
        return np.concatenate([part, np.zeros(pad, dtype=part.dtype)])
    import torch

    return torch.cat([part, part.new_zeros(pad)])


def shard_linear(
    parts: Sequence[Any], bias: Sequence[Any] | None, role: LinearRole, config: ModelConfig, rank: int, tp: int
) -> tuple[list[Any], list[Any] | None]:
    """The rank's slices of a projection's parts (and biases), in the same order."""
    if role in ROW_PARALLEL:
        (weight,) = parts
        cols = weight.shape[1] // tp
        # The partial outputs are summed: the bias is added by the first rank alone.
        return [_contiguous(weight[:, rank * cols : (rank + 1) * cols])], None if bias is None else [
            b if rank == 0 else b * 0 for b in bias
        ]
    if role == "qkv":
        d = config.head_dim
        heads, kv = config.num_heads, config.num_kv_heads
        sizes = [heads * d, kv * d, kv * d]
        local_heads = heads // tp
        kv_first = rank * kv // tp  # the first KV head this rank's query heads use
        local_kv = max(1, kv // tp)
        ranges = [(rank * local_heads * d, local_heads * d), (kv_first * d, local_kv * d), (kv_first * d, local_kv * d)]
    else:  # gate_up
        inter = config.intermediate_size
        sizes = [inter, inter]
        ranges = [(rank * inter // tp, inter // tp)] * 2

    def cut(tensors: Sequence[Any]) -> list[Any]:
        split = _split(tensors, sizes)
        return [t[start : start + n] for t, (start, n) in zip(split, ranges, strict=True)]

    return cut(parts), None if bias is None else cut(bias)


def shard_experts(tensors: ExpertTensors, rank: int, tp: int) -> ExpertTensors:
    """The rank's slice of every expert, as of a dense MLP: its rows of gate and up (and
    of their biases), its columns of down (the partial sums all-reduced after the layer,
    so down's bias is added by the first rank alone); the router whole."""
    n = tensors.gate[0].shape[0] // tp
    rows = slice(rank * n, (rank + 1) * n)
    gate: Sequence[Any]
    up: Sequence[Any]
    down: Sequence[Any]
    if isinstance(tensors.down, Mxfp4Tensor) and n % MXFP4_BLOCK == 0:  # cut packed, kept packed
        assert isinstance(tensors.gate, Mxfp4Tensor) and isinstance(tensors.up, Mxfp4Tensor)
        gate, up, down = tensors.gate.rows(rows), tensors.up.rows(rows), tensors.down.columns(rows.start, rows.stop)
    else:
        gate = [_contiguous(g[rows]) for g in tensors.gate]
        up = [_contiguous(u[rows]) for u in tensors.up]
        down = [_contiguous(d[:, rows]) for d in tensors.down]
    return replace(
        tensors,
        gate=gate,
        up=up,
        down=down,
        gate_bias=None if tensors.gate_bias is None else _contiguous(tensors.gate_bias[:, rows]),
        up_bias=None if tensors.up_bias is None else _contiguous(tensors.up_bias[:, rows]),
        down_bias=tensors.down_bias if tensors.down_bias is None or rank == 0 else tensors.down_bias * 0,
    )


def shard_lora(adapter: LoraAdapter, config: ModelConfig, rank: int, tp: int) -> LoraAdapter:
    """The rank's slices of an adapter's weights (LoraWeights' layouts, at the adapter's rank)."""
    weights = {}
    for (layer, role), w in adapter.weights.items():
        if role in ROW_PARALLEL:  # a: [1, r, in], its input columns
            cols = w.a.shape[2] // tp
            weights[layer, role] = LoraWeights(np.ascontiguousarray(w.a[:, :, rank * cols : (rank + 1) * cols]), w.b)
        else:  # b: [out, parts, r], its output rows as the base weight's (shard_linear)
            rows, _ = shard_linear([w.b], None, role, config, rank, tp)
            weights[layer, role] = LoraWeights(w.a, np.concatenate(rows))
    return LoraAdapter(adapter.path, adapter.rank, weights)


def stage_lora(adapter: LoraAdapter, layers: range) -> LoraAdapter:
    """A pipeline stage's part of an adapter, its layers counted from the stage's first."""
    weights = {(layer - layers.start, role): w for (layer, role), w in adapter.weights.items() if layer in layers}
    return LoraAdapter(adapter.path, adapter.rank, weights)


def _split(tensors: Sequence[Any], sizes: list[int]) -> list[Any]:
    """The parts of a projection, from its parts or its one fused tensor."""
    if len(tensors) == len(sizes):
        return list(tensors)
    (fused,) = tensors
    bounds = np.cumsum([0, *sizes])
    return [fused[lo:hi] for lo, hi in itertools.pairwise(bounds)]


def _contiguous(t: Any) -> Any:
    return np.ascontiguousarray(t) if isinstance(t, np.ndarray) else t.contiguous()
