"""The tensor-parallel process group: joining it, and the collectives the sharded
ops and rank 0's backend use. NCCL on CUDA (one device per rank), gloo on the CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) stays off: the lent multi-GPU hosts cannot use it, and a
# communicator that tries hangs or fails at start-up. Every rank gets these before
# its first NCCL call; symmetric-memory multimem ops are never used.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True, slots=True)
class TensorGroup:
    rank: int
    size: int
    device: torch.device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (capturable in a CUDA graph under NCCL)."""
        dist.all_reduce(x)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] on every rank -> [N, size * C], rank 0's columns first."""
        if self.device.type == "cuda":
            out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
            dist.all_gather_into_tensor(out, x.contiguous())
            parts = out.view(self.size, *x.shape)
        else:  # gloo gathers into a list
            gathered = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(gathered, x.contiguous())
            parts = torch.stack(gathered)
        return parts.permute(1, 0, 2).reshape(x.shape[0], self.size * x.shape[1])

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x, into x on every rank."""
        dist.broadcast(x, src=0)
        return x


def join(rank: int, size: int, port: int, device_type: str) -> TensorGroup:
    """Join the group rendezvousing on 127.0.0.1:port; on CUDA, rank r takes the r-th
    visible device (CUDA_VISIBLE_DEVICES decides which GPUs those are)."""
    os.environ.update(NO_MULTICAST_ENV)
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
        device_id=device if backend == "nccl" else None,
    )  # fmt: skip
    group = TensorGroup(rank, size, device)
    # Warm the communicator up now: NCCL sets a communicator up on its first collective,
    # which must not happen inside a CUDA-graph capture.
    group.all_reduce(torch.zeros(1, device=device))
    return group


def leave() -> None:
    """Tear the group down before the process exits (its threads must not outlive it)."""
    if dist.is_initialized():
        dist.destroy_process_group()
