"""The ranks' process groups: joining them, and the collectives the sharded ops, the
pipeline stages and rank 0's backend use. NCCL on CUDA (one device per rank), gloo on
the CPU.

World size tp * pp. Rank r is tensor-parallel rank r % tp of pipeline stage
pp - 1 - r // tp: ranks 0..tp-1 hold the LAST stage, so rank 0, the process that runs
the engine, samples from logits it computed itself. Each stage's tp ranks form a
TensorGroup; a stage's rank k passes activations to the next stage's rank k."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) stays off: on hosts without multicast support (common on
# virtualised multi-GPU hosts) a communicator that tries hangs or fails at start-up.
# Every rank gets these before its first NCCL call; symmetric-memory multimem ops are
# never used.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True, slots=True)
class TensorGroup:
    """One pipeline stage's tensor-parallel ranks: the collectives inside its forward."""

    rank: int  # within the stage
    size: int
    device: torch.device
    # None: the default group (one stage: every rank). A stage of one rank (tp = 1) runs
    # the plain ops, no collectives.
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (capturable in a CUDA graph under NCCL)."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] on every rank -> [N, size * C], rank 0's columns first."""
        if self.device.type == "cuda":
            out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
            dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
            parts = out.view(self.size, *x.shape)
        else:  # gloo gathers into a list
            gathered = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(gathered, x.contiguous(), group=self.group)
            parts = torch.stack(gathered)
        return parts.permute(1, 0, 2).reshape(x.shape[0], self.size * x.shape[1])


@dataclass(frozen=True, slots=True)
class World:
    """Every rank of the model, from one rank's side: its place, its stage's TensorGroup,
    and the collectives over all ranks (rank 0's sampled ids, the agreed memory)."""

    rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    device: torch.device
    tensor: TensorGroup
    # MoE layers: the tensor-parallel ranks hold whole experts (expert_parallel.py).
    expert_parallel: bool = False

    @property
    def size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def stage(self) -> int:
        return self.pipeline_parallel_size - 1 - self.rank // self.tensor_parallel_size

    def peer(self, stage: int) -> int:
        """The rank of `stage` with this rank's tensor-parallel shard."""
        tp = self.tensor_parallel_size
        return (self.pipeline_parallel_size - 1 - stage) * tp + self.rank % tp

    def min_over_ranks(self, value: int) -> int:
        return self._reduce(value, dist.ReduceOp.MIN)

    def max_over_ranks(self, value: int) -> int:
        return self._reduce(value, dist.ReduceOp.MAX)

    def _reduce(self, value: int, op: dist.ReduceOp.RedOpType) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=op)
        return int(t.item())

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x, into x on every rank."""
        dist.broadcast(x, src=0)
        return x


def join(rank: int, tensor_parallel_size: int, port: int, device_type: str, pipeline_parallel_size: int = 1,
         expert_parallel: bool = False) -> World:  # fmt: skip
    """Join the world rendezvousing on 127.0.0.1:port; on CUDA, rank r takes the r-th
    visible device (CUDA_VISIBLE_DEVICES decides which GPUs those are)."""
    os.environ.update(NO_MULTICAST_ENV)
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp * pp,
        device_id=device if backend == "nccl" else None,
    )  # fmt: skip
    group = None
    if pp > 1 and tp > 1:  # every rank makes every stage's group, in the same order
        for first in range(0, tp * pp, tp):
            made = dist.new_group(list(range(first, first + tp)))
            if first <= rank < first + tp:
                group = made
    world = World(rank, tp, pp, device, TensorGroup(rank % tp, tp, device, group), expert_parallel)
    # Warm the communicators up now: NCCL sets a communicator up on its first collective,
    # which must not happen inside a CUDA-graph capture.
    dist.all_reduce(torch.zeros(1, device=device))
    if group is not None:
        world.tensor.all_reduce(torch.zeros(1, device=device))
    return world


def leave() -> None:
    """Tear the group down before the process exits (its threads must not outlive it)."""
    if dist.is_initialized():
        dist.destroy_process_group()
