"""Tensor parallelism: one model over several devices of a host (torch.distributed:
NCCL on CUDA, gloo on the CPU).

- layout.py: which slice of each weight a rank holds, and the rank's view of the model.
- group.py: the process group and its collectives.
- sharded_ops.py: the decoder's torch ops over the rank's shard (worker.models.llama).
- ranks.py: the rank processes; rank 0's backend sends each step to the others.
"""
