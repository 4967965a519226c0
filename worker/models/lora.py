"""LoRA adapters in the Hugging Face PEFT format, mapped onto the decoder's fused projections.

A PEFT adapter directory holds `adapter_config.json` (r, lora_alpha, target_modules,
use_rslora) and `adapter_model.safetensors` with, per adapted module,
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]. Its delta is `y += scaling * (x @ A.T) @ B.T` with
scaling = alpha / r (alpha / sqrt(r) with rsLoRA).

The decoder runs fused projections (qkv; gate_up), so an adapter is held per layer and
role: the parts' A matrices stacked along the rank ([parts, r, in]) and their B matrices
side by side ([out, parts, r]), block-diagonal: part p's rows of the output see only
part p's rank slice. A part the adapter leaves alone is zero. The scaling is folded
into B, so every backend computes a plain `(x @ A.T) @ B.T` per token.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from worker.models.config import CheckpointError, ModelConfig
from worker.models.llama import LinearRole
from worker.models.safetensors_io import read_float32, read_header

# Which fused role and part each PEFT target module is; part None: the whole fused
# projection, as checkpoints that store it fused name it (Phi-3's qkv_proj, gate_up_proj).
TARGET_MODULES: dict[str, tuple[LinearRole, int | None]] = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
    "qkv_proj": ("qkv", None), "gate_up_proj": ("gate_up", None),
}  # fmt: skip
ROLES: tuple[LinearRole, ...] = ("qkv", "o", "gate_up", "down")

# A mixture-of-experts layer's experts and router (worker/models/moe_checkpoint.py).
_EXPERT = re.compile(r"\.(?:experts|block_sparse_moe|router)\.|\.mlp\.gate\.")
_MLP = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
_TENSOR = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight")


def role_shape(config: ModelConfig, role: LinearRole) -> tuple[int, list[int]]:
    """(input width, output width of each fused part) of a projection."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "qkv": (config.hidden_size, [q, kv, kv]),
        "o": (q, [config.hidden_size]),
        "gate_up": (config.hidden_size, [config.intermediate_size] * 2),
        "down": (config.intermediate_size, [config.hidden_size]),
    }[role]


@dataclass(frozen=True, slots=True)
class LoraWeights:
    """One projection's adapter, its parts stacked at rank `rank` (zero-padded)."""

    a: np.ndarray  # float32 [parts, rank, in]
    b: np.ndarray  # float32 [out, parts, rank], scaling folded in; zero off each part's block


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    path: str
    rank: int  # the largest rank of any adapted module
    weights: dict[tuple[int, LinearRole], LoraWeights]  # (layer, role) -> weights; absent: not adapted

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


def load_lora_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check a PEFT LoRA adapter against the model; CheckpointError names the problem."""
    directory = Path(path)
    cfg_file, weights_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    for file in (cfg_file, weights_file):
        if not file.is_file():
            raise CheckpointError(f"LoRA adapter {directory}: {file.name} is missing")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"LoRA adapter {directory}: adapter_config.json is not readable JSON: {e}") from None
    _check_config(cfg, directory)
    try:
        refs = read_header(weights_file)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"LoRA adapter {directory}: adapter_model.safetensors: {e}") from None

    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, ref in refs.items():
        m = _TENSOR.fullmatch(name)
        if _EXPERT.search(name) or (m is not None and m.group(2) in _MLP and int(m.group(1)) in config.moe_layers):
            raise CheckpointError(f"LoRA adapter {directory}: tensor {name} adapts the experts of a mixture-of-experts "
                                  "layer, which is not supported (adapters on the attention projections are)")
        if m is None or m.group(2) not in TARGET_MODULES:
            module = m.group(2) if m else name
            raise CheckpointError(f"LoRA adapter {directory}: unsupported target module {module!r} (tensor {name}); "
                                  f"supported: {', '.join(TARGET_MODULES)}")
        layer = int(m.group(1))
        if layer >= config.num_layers:
            raise CheckpointError(f"LoRA adapter {directory}: tensor {name} is for layer {layer}, "
                                  f"the model has {config.num_layers} layers")
        found.setdefault((layer, m.group(2)), {})[m.group(3)] = read_float32(ref)
    if not found:
        raise CheckpointError(f"LoRA adapter {directory}: adapter_model.safetensors holds no LoRA tensors")

    ranks = {key: _check_pair(key, ab, config, max_rank, directory) for key, ab in found.items()}
    rank = max(ranks.values())
    alpha = float(cfg.get("lora_alpha", cfg["r"]))
    weights: dict[tuple[int, LinearRole], LoraWeights] = {}
    for (layer, module), ab in sorted(found.items()):
        role, part = TARGET_MODULES[module]
        width, outs = role_shape(config, role)
        w = weights.get((layer, role))
        if w is None:
            w = LoraWeights(np.zeros((len(outs), rank, width), np.float32),
                            np.zeros((sum(outs), len(outs), rank), np.float32))  # fmt: skip
            weights[layer, role] = w
        r = ranks[layer, module]
        # PEFT scales by the configured r, whatever rank each module's tensors have.
        scaling = alpha / (math.sqrt(cfg["r"]) if cfg.get("use_rslora") else cfg["r"])
        # A module over the whole fused projection is its parts sharing one A: part p's
        # output rows are B's rows of p times A x, which the block-diagonal layout computes.
        for p in range(len(outs)) if part is None else [part]:
            lo = sum(outs[:p])
            rows = ab["B"][lo : lo + outs[p]] if part is None else ab["B"]
            w.a[p, :r] = ab["A"]
            w.b[lo : lo + outs[p], p, :r] = rows * np.float32(scaling)
    return LoraAdapter(str(directory), rank, weights)


def _check_config(cfg: dict[str, object], directory: Path) -> None:
    problem = None
    if cfg.get("peft_type", "LORA") != "LORA":
        problem = f"peft_type {cfg.get('peft_type')!r} is not LORA"
    elif not isinstance(cfg.get("r"), int) or int(cfg["r"]) < 1:  # type: ignore[call-overload]
        problem = f"r must be a positive integer, got {cfg.get('r')!r}"
    elif cfg.get("use_dora"):
        problem = "DoRA (use_dora) is not supported"
    elif cfg.get("bias", "none") != "none":
        problem = f"bias {cfg.get('bias')!r} is not supported (only 'none')"
    elif cfg.get("modules_to_save"):
        problem = f"modules_to_save {cfg.get('modules_to_save')} is not supported (it replaces whole modules)"
    elif cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        problem = "rank_pattern / alpha_pattern are not supported"
    else:
        targets = cfg.get("target_modules")
        if isinstance(targets, list):
            bad = [t for t in targets if t.rsplit(".", 1)[-1] not in TARGET_MODULES]
            if bad:
                problem = (f"unsupported target module {bad[0]!r} in target_modules; "
                           f"supported: {', '.join(TARGET_MODULES)}")
    # fan_in_fan_out only transposes a Conv1D base weight when merging; lora_A and
    # lora_B are plain Linear layers either way, so it does not change the delta here.
    if problem is not None:
        raise CheckpointError(f"LoRA adapter {directory}: adapter_config.json: {problem}")


def _check_pair(key: tuple[int, str], ab: dict[str, np.ndarray], config: ModelConfig, max_rank: int,
                directory: Path) -> int:
    """The rank of one module's A [r, in] and B [out, r], checked against the model."""
    layer, module = key
    where = f"LoRA adapter {directory}: layer {layer} {module}"
    if set(ab) != {"A", "B"}:
        raise CheckpointError(f"{where}: lora_{'B' if 'A' in ab else 'A'}.weight is missing")
    a, b = ab["A"], ab["B"]
    role, part = TARGET_MODULES[module]
    width, outs = role_shape(config, role)
    out = sum(outs) if part is None else outs[part]
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != width or b.shape[0] != out or b.shape[1] != a.shape[0]:
        raise CheckpointError(f"{where}: shape mismatch with the model: lora_A {list(a.shape)}, lora_B "
                              f"{list(b.shape)}; the model needs lora_A [r, {width}] and lora_B [{out}, r]")
    rank = int(a.shape[0])
    if rank > max_rank:
        raise CheckpointError(f"{where}: rank {rank} is above max_rank {max_rank} (PeftCacheConfig.max_rank)")
    return rank
