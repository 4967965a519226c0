"""One rank's pipeline stage: which layers it runs, the ranks before and after it, and a
step's run over micro-batches (micro_batches.py).

Each stage runs micro-batch i, hands its hidden state on with a send that does not
wait (isend), and goes on to i + 1 while the next stage runs i: with M micro-batches
the stages overlap for all but the pipeline's fill and drain. The hidden state is the
residual stream and the last layer's output, stacked into one [2, T, hidden] message
so the next stage's first add + norm is the one the whole model runs. Rank 0's stage is
the last (group.py): the logits of every micro-batch come back there, in the step's
row order. The steps of a stage run eagerly (no CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from worker.backends.base import ForwardBatch
from worker.backends.torch_step import StepInputs
from worker.models.config import ModelConfig
from worker.parallel import layout, micro_batches
from worker.parallel.group import World


class PipelineStage:
    """A StageLink (worker.models.llama) between this rank and its neighbour stages."""

    def __init__(self, world: World, config: ModelConfig, dtype: torch.dtype, micro_batch_count: int = 0) -> None:
        """`micro_batch_count`: how many micro-batches a step is cut into (0: one per stage)."""
        pp = world.pipeline_parallel_size
        self.index = world.stage
        self.layers = layout.stage_layers(config.num_layers, pp, self.index)
        self.previous = world.peer(self.index - 1) if self.index > 0 else None
        self.next = world.peer(self.index + 1) if self.index < pp - 1 else None
        self.micro_batch_count = micro_batch_count or pp
        self.hidden_size, self.dtype, self.device = config.hidden_size, dtype, world.device
        self._sends: list[dist.Work] = []

    @property
    def is_last(self) -> bool:
        return self.next is None

    # -- StageLink ----------------------------------------------------------------------------

    def receive(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        state = torch.empty((2, step.tokens.shape[0], self.hidden_size), dtype=self.dtype, device=self.device)
        dist.recv(state, src=self.previous)
        return state[0], state[1]

    def send(self, x: torch.Tensor, residual: torch.Tensor, step: StepInputs) -> torch.Tensor:
        state = torch.stack((x, residual))
        work = dist.isend(state, dst=self.next)
        assert work is not None
        self._sends.append(work)  # it holds `state` until the next stage has it
        return state

    # -- a step ------------------------------------------------------------------------------

    def run(self, batch: ForwardBatch, upload: Callable[[ForwardBatch], StepInputs],
            run_model: Callable[[StepInputs], torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """The step's logits [S, vocab] on the last stage; an empty tensor on the others."""
        parts = micro_batches.split(batch, self.micro_batch_count)
        logits = [run_model(upload(part.batch)) for part in parts]
        for work in self._sends:
            work.wait()
        self._sends.clear()
        if not self.is_last:
            return torch.empty(0, device=self.device)
        if len(parts) == 1:
            return logits[0]
        joined = torch.cat(logits)
        order = np.concatenate([part.rows for part in parts])
        if np.array_equal(order, np.arange(order.shape[0])):
            return joined
        out = torch.empty_like(joined)
        out[torch.from_numpy(order).to(self.device)] = joined
        return out
