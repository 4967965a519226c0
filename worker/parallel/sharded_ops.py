"""The decoder's torch ops (worker.models.llama.DecoderOps) over one tensor-parallel
rank's shard: the float weights (and LoRA adapters) are sliced (layout.py) before
TorchDecoderOps makes its weights of them, and the step ops add the collectives the
slices call for.

A row-parallel projection's all-reduce is in `lora`, which the decoder calls after
every `linear` whether or not the step runs an adapter: the rank's partial output and
its adapter delta (from the rank's input columns) are summed across ranks in one
all-reduce. A mixture-of-experts layer holds a slice of every expert, or under expert
parallelism the rank's whole experts (expert_parallel.py); either way its output is a
partial sum, all-reduced."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from worker.backends.quant_linear import QuantLinear
from worker.backends.torch_decoder_ops import TorchDecoderOps, TorchLinear
from worker.backends.torch_moe import TorchExperts
from worker.backends.torch_step import StepInputs
from worker.models.config import ModelConfig
from worker.models.llama import LinearRole
from worker.models.lora import LoraAdapter
from worker.models.moe_checkpoint import ExpertTensors
from worker.parallel import expert_parallel, layout
from worker.parallel.group import TensorGroup


class ShardedTorchDecoderOps(TorchDecoderOps):
    def __init__(
        self, config: ModelConfig, group: TensorGroup, device: torch.device, dtype: torch.dtype, max_model_len: int,
        expert_parallel: bool = False, **kwargs: Any,
    ) -> None:
        """`config` is the whole model's; the inherited ops (KV pool, attention, rope)
        see the rank's heads (layout.local_config). `expert_parallel`: the rank holds
        whole experts, not a slice of each. `kwargs` go to TorchDecoderOps
        (quantization, the KV cache's dtype): shards are cut from the float parts first."""
        super().__init__(layout.local_config(config, group.size, expert_parallel), device, dtype, max_model_len,
                         **kwargs)  # fmt: skip
        self.full_config = config
        self.group = group
        self.expert_parallel = expert_parallel
        self.vocab_start, self.vocab_rows = layout.vocab_shard(config.vocab_size, group.rank, group.size)
        self._embed: torch.Tensor | None = None

    # -- weights ----------------------------------------------------------------------------

    def embedding_weight(self, tensor: torch.Tensor | np.ndarray) -> torch.Tensor:
        self._embed = super().embedding_weight(layout.shard_vocab(tensor, self.group.rank, self.group.size))
        return self._embed

    def lm_head_weight(self, tensor: torch.Tensor | np.ndarray) -> torch.Tensor:
        if tensor is self._embed:  # tied: the embedding's shard is the lm head's
            return tensor
        return super().lm_head_weight(layout.shard_vocab(tensor, self.group.rank, self.group.size))

    def head_weight(self, tensor: torch.Tensor | np.ndarray) -> torch.Tensor:
        """The rank's query heads' values."""
        n = tensor.shape[0] // self.group.size
        return super().head_weight(tensor[self.group.rank * n : (self.group.rank + 1) * n])

    def linear_weight(  # type: ignore[override]
        self,
        parts: Sequence[torch.Tensor | np.ndarray],
        bias: Sequence[torch.Tensor | np.ndarray] | None,
        role: LinearRole,
    ) -> TorchLinear | QuantLinear:
        """The rank's slice, as TorchDecoderOps makes it (quantized after the cut)."""
        g = self.group
        parts, bias = layout.shard_linear(parts, bias, role, self.full_config, g.rank, g.size)
        return super().linear_weight(parts, bias, role)

    def expert_weights(self, tensors: ExpertTensors) -> TorchExperts:
        """The rank's slice of every expert's intermediate width (layout.shard_experts), or
        under expert parallelism its whole experts, stacked from local id 0."""
        g = self.group
        if not self.expert_parallel:
            return super().expert_weights(layout.shard_experts(tensors, g.rank, g.size))
        held = expert_parallel.expert_range(len(tensors.gate), g.rank, g.size)
        experts = super().expert_weights(expert_parallel.place_experts(tensors, g.rank, g.size))
        return replace(experts, first_expert=held.start)

    def load_lora_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        """The slots hold the rank's slices (allocate_lora sized them by the rank's heads)."""
        if adapter is not None:
            adapter = layout.shard_lora(adapter, self.full_config, self.group.rank, self.group.size)
        super().load_lora_slot(slot, adapter)

    # -- one step ---------------------------------------------------------------------------

    def embedding(self, table: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """A lookup of the rank's vocabulary range (zero rows for other tokens), summed."""
        local = step.tokens.long() - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_rows)
        rows = F.embedding(torch.where(mine, local, 0), table) * mine.unsqueeze(1).to(table.dtype)
        return self.group.all_reduce(rows)

    def lora(self, y: torch.Tensor, x: torch.Tensor, layer: int, role: LinearRole, step: StepInputs,
             logits_rows: bool) -> torch.Tensor:
        """The rank's delta added; a row-parallel projection's sum (base and delta) all-reduced."""
        y = super().lora(y, x, layer, role, step, logits_rows)
        return self.group.all_reduce(y) if role in layout.ROW_PARALLEL else y

    def moe(self, x: torch.Tensor, experts: TorchExperts, layer: int, step: StepInputs,
            logits_rows: bool) -> torch.Tensor:  # fmt: skip
        """Every rank routes alike (the router is whole) and counts every token's choices;
        the partial sums of its experts' slices (or of its whole experts) all-reduced."""
        return self.group.all_reduce(super().moe(x, experts, layer, step, logits_rows))

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Every rank's logits over its vocabulary range, gathered into [S, vocab]."""
        logits = self.group.all_gather_columns(super().lm_head(x, weight))
        vocab = self.full_config.vocab_size
        return logits if logits.shape[1] == vocab else logits[:, :vocab].contiguous()
