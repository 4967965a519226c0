"""How checkpoints name and lay out a mixture-of-experts layer's tensors, and their reading
into one form the backends take (`ExpertTensors`): the router [experts, hidden] and each
expert's gate, up [intermediate, hidden] and down [hidden, intermediate] projections.

Three layouts (ModelConfig.moe_checkpoint), as transformers' save_pretrained writes them
and as the published checkpoints ship:
- "mixtral": `block_sparse_moe.gate` and `block_sparse_moe.experts.E.w1 | w3 | w2` (gate, up, down);
- "qwen": `mlp.gate` and `mlp.experts.E.gate_proj | up_proj | down_proj`;
- "gpt_oss": `mlp.router` (with a bias) and every expert in one tensor, gate_up_proj
  [experts, hidden, 2 * intermediate] with gate and up interleaved column by column, and
  down_proj [experts, intermediate, hidden] (each with a bias). Its MXFP4 checkpoints'
  projections come packed (an `Mxfp4File` or an `Mxfp4Tensor`, rows first): gate, up and
  down are then `Mxfp4Tensor`s, which a backend takes packed or as float experts.
Tensors may be numpy arrays or torch tensors; only indexing, slicing and swapaxes are used.
Per-expert tensors are read when an expert is first indexed, so a rank that holds some of
the experts (worker/parallel/expert_parallel.py) reads only theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, overload

from worker.models.config import CheckpointError, ModelConfig
from worker.models.mxfp4 import Mxfp4Tensor
from worker.models.mxfp4_checkpoint import Mxfp4File

LAYOUTS = ("mixtral", "qwen", "gpt_oss")
_PER_EXPERT = {"mixtral": ("block_sparse_moe", "gate", ("w1", "w3", "w2")),
               "qwen": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))}  # fmt: skip
_EVEN, _ODD = slice(0, None, 2), slice(1, None, 2)  # gpt-oss's gate and up rows


@dataclass(frozen=True, slots=True)
class ExpertTensors:
    """One MoE layer's weights in Hugging Face's [out, in] orientation; `gate`, `up` and
    `down` index by expert (a list, or a stacked [experts, ...] tensor)."""

    router: Any  # [experts, hidden]
    router_bias: Any | None  # [experts]
    gate: Sequence[Any]  # experts x [intermediate, hidden]
    up: Sequence[Any]  # experts x [intermediate, hidden]
    down: Sequence[Any]  # experts x [hidden, intermediate]
    gate_bias: Any | None = None  # [experts, intermediate]
    up_bias: Any | None = None  # [experts, intermediate]
    down_bias: Any | None = None  # [experts, hidden]


class PerExpert(Sequence[Any]):
    """One projection of every expert, each tensor read from the checkpoint when indexed;
    a slice is the same over fewer experts, reading nothing."""

    def __init__(self, need: Callable[[str], Any], names: Sequence[str]) -> None:
        self._need, self._names = need, names

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> PerExpert: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return PerExpert(self._need, self._names[index])
        return self._need(self._names[index])

    def __len__(self) -> int:
        return len(self._names)


def _layout(config: ModelConfig) -> str:
    if config.moe_checkpoint not in LAYOUTS:
        raise CheckpointError(f"moe_checkpoint {config.moe_checkpoint!r} is not a known layout ({', '.join(LAYOUTS)})")
    return config.moe_checkpoint


def expert_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The layer's MoE tensors with their shapes, as the checkpoint names them."""
    h, inter, n = config.hidden_size, config.moe_intermediate_size, config.num_experts
    p = f"model.layers.{layer}."
    layout = _layout(config)
    if layout == "gpt_oss":
        return {
            p + "mlp.router.weight": (n, h), p + "mlp.router.bias": (n,),
            p + "mlp.experts.gate_up_proj": (n, h, 2 * inter), p + "mlp.experts.gate_up_proj_bias": (n, 2 * inter),
            p + "mlp.experts.down_proj": (n, inter, h), p + "mlp.experts.down_proj_bias": (n, h),
        }  # fmt: skip
    block, router, (gate, up, down) = _PER_EXPERT[layout]
    shapes: dict[str, tuple[int, ...]] = {f"{p}{block}.{router}.weight": (n, h)}
    for e in range(n):
        expert = f"{p}{block}.experts.{e}."
        shapes |= {expert + f"{gate}.weight": (inter, h), expert + f"{up}.weight": (inter, h),
                   expert + f"{down}.weight": (h, inter)}  # fmt: skip
    return shapes


def expert_tensors(config: ModelConfig, need: Callable[[str], Any], layer: int) -> ExpertTensors:
    """The layer's experts from the checkpoint's tensors; `need` raises naming a missing one."""
    p = f"model.layers.{layer}."
    layout = _layout(config)
    if layout == "gpt_oss":
        gate_up, down = _packed(need(p + "mlp.experts.gate_up_proj")), _packed(need(p + "mlp.experts.down_proj"))
        if isinstance(gate_up, Mxfp4Tensor):  # packed rows first: [experts, 2I, hidden]
            gate_rows, up_rows = gate_up.rows(_EVEN), gate_up.rows(_ODD)
        else:
            # [experts, hidden, 2I] with gate and up interleaved -> [experts, 2I, hidden], then split.
            gate_up, down = gate_up.swapaxes(1, 2), down.swapaxes(1, 2)
            gate_rows, up_rows = gate_up[:, _EVEN], gate_up[:, _ODD]
        gate_up_bias = need(p + "mlp.experts.gate_up_proj_bias")
        return ExpertTensors(
            router=need(p + "mlp.router.weight"),
            router_bias=need(p + "mlp.router.bias"),
            gate=gate_rows,
            up=up_rows,
            down=down,
            gate_bias=gate_up_bias[:, _EVEN],
            up_bias=gate_up_bias[:, _ODD],
            down_bias=need(p + "mlp.experts.down_proj_bias"),
        )
    block, router, (gate, up, down) = _PER_EXPERT[layout]
    experts = [f"{p}{block}.experts.{e}." for e in range(config.num_experts)]
    return ExpertTensors(
        router=need(f"{p}{block}.{router}.weight"),
        router_bias=None,
        gate=PerExpert(need, [e + f"{gate}.weight" for e in experts]),
        up=PerExpert(need, [e + f"{up}.weight" for e in experts]),
        down=PerExpert(need, [e + f"{down}.weight" for e in experts]),
    )


def _packed(tensor: Any) -> Any:
    """An MXFP4 projection still on disk, read (packed); anything else as it is."""
    return tensor.read() if isinstance(tensor, Mxfp4File) else tensor
