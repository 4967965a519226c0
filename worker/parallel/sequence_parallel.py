"""Sequence parallelism for a tensor-parallel stage's large steps. Between a row-parallel
projection (o, down) and the next column-parallel one (qkv, gate_up) each rank holds a
1/size share of the step's rows: the all-reduce after o and down becomes a reduce-scatter
fused into their GEMM, and an all-gather is fused into the next GEMM. The bytes over
NVLink are the all-reduce's, but torch's symmetric-memory ops (`fused_matmul_reduce_scatter`,
`fused_all_gather_matmul`) move one chunk of rows while the GEMM of another runs, so the
transfer hides behind the GEMM; and the add + RMSNorm between them runs on the rank's
rows alone. On two H200s a 70B prefill step's all-reduces were 9 % of the step, in the
open.

A step is split only when it has enough rows for the chunked GEMMs to keep their rate
(`min_rows`), runs no LoRA adapter (its delta would need a reduce-scatter of its own) and
is not being captured in a CUDA graph (the fused ops barrier between the ranks). Its rows
are padded to a multiple of the group's size; the pad rows are zero in the residual
stream and are dropped when the rows are gathered back.

Off CUDA (gloo, the CPU tests) the same split runs with plain collectives: an all-gather
before the GEMM, an all-reduce after it of which the rank keeps its share."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from worker.parallel.group import TensorGroup

log = logging.getLogger(__name__)

Linear = Callable[[torch.Tensor], torch.Tensor]  # x [N, in] -> [N, out], the rank's shard


@dataclass(frozen=True, slots=True)
class RowSplit:
    """One step's rows across the group: this rank holds rows [start, start + local) of
    the step padded to `padded` rows."""

    rows: int
    padded: int
    local: int
    start: int


class SequenceParallel:
    def __init__(self, group: TensorGroup, hidden: int, dtype: torch.dtype, max_rows: int, min_rows: int) -> None:
        """Collective on CUDA: the ranks set up the fused ops' symmetric workspace together
        (sized for `max_rows`, so no step allocates it), and agree on whether it worked."""
        self.group = group
        self.min_rows = min_rows
        self.fused = False
        if group.device.type == "cuda":
            self.fused = self._set_up_workspace(2 * -(-max_rows // group.size) * hidden * dtype.itemsize)

    def _set_up_workspace(self, size: int) -> bool:
        import torch.distributed._symmetric_memory as symm_mem

        pg = self.group.group or dist.group.WORLD
        assert pg is not None
        self._name = pg.group_name
        ok = torch.ones(1, device=self.group.device)
        try:
            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # older torch needs it
                symm_mem.enable_symm_mem_for_group(self._name)
            symm_mem.get_symm_mem_workspace(self._name, min_size=size)
        except Exception as e:  # no symmetric memory here: the plain collectives serve
            log.warning("sequence parallelism: symmetric workspace unavailable (%s: %s); plain collectives",
                        type(e).__name__, e)  # fmt: skip
            ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group.group)
        return bool(ok.item())

    def plan(self, rows: int) -> RowSplit | None:
        """The step's split, or None when it runs as plain tensor parallelism."""
        if rows < self.min_rows or (self.group.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return None
        local = -(-rows // self.group.size)
        return RowSplit(rows, local * self.group.size, local, local * self.group.rank)

    def scatter(self, x: torch.Tensor, split: RowSplit) -> torch.Tensor:
        """Partial sums x [rows, C] -> this rank's rows of their sum [local, C]."""
        x = _pad_rows(x, split.padded)
        if self.group.device.type == "cuda":
            out = x.new_empty((split.local, x.shape[1]))
            dist.reduce_scatter_tensor(out, x, group=self.group.group)
            return out
        dist.all_reduce(x, group=self.group.group)  # gloo has no reduce-scatter
        return x[split.start : split.start + split.local]

    def gather(self, x: torch.Tensor, split: RowSplit) -> torch.Tensor:
        """This rank's rows [local, C] -> every row of the step [rows, C]."""
        if self.group.device.type == "cuda":
            out = x.new_empty((split.padded, x.shape[1]))
            dist.all_gather_into_tensor(out, x.contiguous(), group=self.group.group)
        else:
            parts = [torch.empty_like(x) for _ in range(self.group.size)]
            dist.all_gather(parts, x.contiguous(), group=self.group.group)
            out = torch.cat(parts)
        return out[: split.rows]

    def gather_linear(self, x: torch.Tensor, weight: torch.Tensor | None, linear: Linear,
                      split: RowSplit) -> torch.Tensor:  # fmt: skip
        """A column-parallel projection of the step's rows from this rank's [local, in]:
        [rows, out]. `weight` [out, in] (bias-free bf16) takes the fused op; else `linear`
        runs on the gathered rows."""
        if self.fused and weight is not None:
            _, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(x.contiguous(), [weight.t()], 0, self._name,
                                                                   return_A=False)  # fmt: skip
            return out[: split.rows]
        return linear(self.gather(x, split))

    def linear_scatter(self, x: torch.Tensor, weight: torch.Tensor | None, linear: Linear,
                       split: RowSplit) -> torch.Tensor:  # fmt: skip
        """A row-parallel projection of the step's rows [rows, in], summed over the ranks:
        this rank's rows of it [local, out]."""
        x = _pad_rows(x, split.padded)
        if self.fused and weight is not None:
            return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, weight.t(), "sum", 0, self._name)
        return self.scatter(linear(x), split)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else F.pad(x, (0, 0, 0, rows - x.shape[0]))
