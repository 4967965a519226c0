"""Tensor and pipeline parallelism: one model over several devices of a host
(torch.distributed: NCCL on CUDA, gloo on the CPU).

- layout.py: which layers (pipeline stage) and which slice of each weight (tensor
  parallelism) a rank holds, and the rank's view of the model.
- expert_parallel.py: mixture-of-experts layers with whole experts per rank, and why
  their outputs meet in one all-reduce.
- group.py: the ranks' places, their process groups and collectives.
- sharded_ops.py: the decoder's torch ops over the rank's shard (worker.models.llama).
- pipeline.py: a stage's hand-offs to its neighbours and its run over micro-batches
  (micro_batches.py: a step cut by sequences).
- ranks.py: the rank processes; rank 0's backend sends each step to the others.
"""
