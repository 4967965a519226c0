"""Expert parallelism: a mixture-of-experts layer's experts placed whole on the
tensor-parallel ranks, instead of every expert sharded across them (layout.shard_experts).

Placement: with E experts over N ranks, rank r holds the contiguous run of experts
r * E / N .. (r + 1) * E / N - 1 (E must divide by N), and reads only their tensors from the
checkpoint. Attention, the dense layers, the embedding and the lm head stay
tensor-parallel, and every rank keeps the whole router.

The exchange: after attention's all-reduce every rank holds every token's hidden state,
so every rank routes all tokens alike (the same router, the same input), computes its own
experts' weighted outputs for the tokens routed to them (zero for the others), and one
all-reduce of [T, hidden] sums the ranks' parts, the same collective the sharded layout
ends the layer with. The router statistics need nothing extra: every rank counts every
token's choices, as one rank does, and rank 0 reports its own counts.

The alternatives. The tokens start replicated, so sending them to their experts' ranks
costs nothing; only the combine moves data, and its result must be replicated again for
the next layer's attention. A ring all-reduce of T rows sends 2 * T * (N - 1) / N rows
per rank. An all-to-all of each pair's output to its token's home rank followed by an
all-gather is the same reduce-scatter + all-gather the ring runs, with uneven splits. An
all-gather of each rank's compact per-pair outputs (T * k / N weighted rows on average)
has every rank receive T * k * (N - 1) / N rows: fewer bytes than the all-reduce only for
top-1 routers, as many for top-2, more for top-4 and top-8; and its sizes change with
each step's routing, so the buffers are padded to the worst case (one rank may own all
T * k pairs) or the counts read on the host, which stalls the step and cannot be
captured in a CUDA graph. At decode (T a few dozen rows: a few hundred KB) a collective
is bound by its latency, and one call beats two; at prefill (T in the thousands: tens of
MB) the all-reduce moves no more bytes than the alternatives for k >= 2. An all-to-all
dispatch pays when the tokens are not replicated (data-parallel attention, each rank
holding only its own requests' rows), which is not this engine's layout.

What placement buys over sharding is the shape of the experts' work: sharding cuts each
expert's intermediate width by N (Qwen3-MoE's 768 over 8 ranks leaves 96 columns, too
narrow for efficient GEMM tiles, and a width that does not divide is refused), while a
placed expert runs at its whole width on one rank. The bytes a decode step reads are the
same in total (1 / N of every routed expert on every rank, or each routed expert whole on
one); what placement costs is balance: a rank whose experts the router favours in a step
does more of the layer's work, and the others wait for it at the all-reduce.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from worker.models.config import ModelConfig
from worker.models.moe_checkpoint import ExpertTensors


def validate(config: ModelConfig, tp: int) -> None:
    """Raise ValueError when the model's experts cannot be placed whole on `tp` ranks."""
    if not config.is_moe:
        raise ValueError(f"expert parallelism needs a mixture-of-experts model; model_type {config.model_type!r} "
                         "has no experts")  # fmt: skip
    if config.num_experts % tp:
        raise ValueError(f"expert parallelism: {config.num_experts} experts do not split evenly over {tp} "
                         "tensor-parallel ranks")  # fmt: skip


def expert_range(num_experts: int, rank: int, tp: int) -> range:
    """The global ids of the experts rank `rank` of `tp` holds."""
    per_rank = num_experts // tp
    return range(rank * per_rank, (rank + 1) * per_rank)


def place_experts(tensors: ExpertTensors, rank: int, tp: int) -> ExpertTensors:
    """The rank's experts, whole, and the whole router: only their tensors are read."""
    held = expert_range(len(tensors.gate), rank, tp)
    cut = slice(held.start, held.stop)
    return replace(
        tensors,
        gate=tensors.gate[cut],
        up=tensors.up[cut],
        down=tensors.down[cut],
        gate_bias=_rows(tensors.gate_bias, cut),
        up_bias=_rows(tensors.up_bias, cut),
        down_bias=_rows(tensors.down_bias, cut),
    )


def _rows(bias: Any | None, cut: slice) -> Any | None:
    return None if bias is None else bias[cut]
