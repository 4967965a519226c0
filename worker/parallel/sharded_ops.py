"""The decoder's torch ops (worker.models.llama.DecoderOps) over one tensor-parallel
rank's shard: the float weights are sliced (layout.py) before TorchDecoderOps makes
its weights of them, and the step ops add the collectives the slices call for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from worker.backends.quant_linear import QuantLinear
from worker.backends.torch_decoder_ops import TorchDecoderOps, TorchLinear
from worker.backends.torch_step import StepInputs
from worker.models.config import ModelConfig
from worker.models.llama import LinearRole
from worker.parallel import layout
from worker.parallel.group import TensorGroup


@dataclass(frozen=True, slots=True)
class ShardedLinear:
    weight: TorchLinear | QuantLinear  # the rank's slice, as TorchDecoderOps made it (quantized after the cut)
    all_reduce: bool  # row-parallel: the rank's output is a partial sum


class ShardedTorchDecoderOps(TorchDecoderOps):
    def __init__(
        self, config: ModelConfig, group: TensorGroup, device: torch.device, dtype: torch.dtype, max_model_len: int,
        **kwargs: Any,
    ) -> None:
        """`config` is the whole model's; the inherited ops (KV pool, attention, rope)
        see the rank's heads (layout.local_config). `kwargs` go to TorchDecoderOps
        (quantization, the KV cache's dtype): shards are cut from the float parts first."""
        super().__init__(layout.local_config(config, group.size), device, dtype, max_model_len, **kwargs)
        self.full_config = config
        self.group = group
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

    def linear_weight(  # type: ignore[override]
        self,
        parts: Sequence[torch.Tensor | np.ndarray],
        bias: Sequence[torch.Tensor | np.ndarray] | None,
        role: LinearRole,
    ) -> ShardedLinear:
        g = self.group
        parts, bias = layout.shard_linear(parts, bias, role, self.full_config, g.rank, g.size)
        return ShardedLinear(super().linear_weight(parts, bias, role), all_reduce=role in ("o", "down"))

    # -- one step ---------------------------------------------------------------------------

    def embedding(self, table: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """A lookup of the rank's vocabulary range (zero rows for other tokens), summed."""
        local = step.tokens.long() - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_rows)
        rows = F.embedding(torch.where(mine, local, 0), table) * mine.unsqueeze(1).to(table.dtype)
        return self.group.all_reduce(rows)

    def linear(self, x: torch.Tensor, weight: ShardedLinear) -> torch.Tensor:  # type: ignore[override]
        y = super().linear(x, weight.weight)
        return self.group.all_reduce(y) if weight.all_reduce else y

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Every rank's logits over its vocabulary range, gathered into [S, vocab]."""
        logits = self.group.all_gather_columns(super().lm_head(x, weight))
        vocab = self.full_config.vocab_size
        return logits if logits.shape[1] == vocab else logits[:, :vocab].contiguous()
