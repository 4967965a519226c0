"""The decoder's ops (worker.models.llama.DecoderOps) in float32 numpy, and the KV pool.

Linear weights are stored [in, out], contiguous, so a projection is one `x @ W` GEMM;
the lm head stays a transposed view of its [vocab, hidden] tensor (no copy of what is
often the largest matrix, and none at all when it is the embedding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from worker.backends.numpy_attention import AttentionPlan, paged_attention_numpy
from worker.backends.row_tiles import matmul_rows_numpy
from worker.models.config import CheckpointError, ModelConfig
from worker.models.expert_act import expert_act
from worker.models.llama import LinearRole
from worker.models.lora import LoraAdapter
from worker.models.moe_checkpoint import ExpertTensors
from worker.models.moe_routing import route
from worker.models.quantization import Fp8Inputs, QuantizedWeight, fake_quantize_inputs, fp8_inputs, reference_parts


@dataclass(frozen=True, slots=True)
class NumpyLinear:
    weight: np.ndarray  # [in, out]
    bias: np.ndarray | None  # [out]
    fp8_inputs: Fp8Inputs | None = None  # FP8 layers: inputs rounded to e4m3 as on the GPU


@dataclass(frozen=True, slots=True)
class NumpyExperts:
    """One MoE layer: the router and every expert's projections, stacked, [in, out] each."""

    router: np.ndarray  # [hidden, experts]
    router_bias: np.ndarray | None  # [experts]
    gate_up: np.ndarray  # [experts, hidden, 2 * intermediate]: gate, then up
    down: np.ndarray  # [experts, intermediate, hidden]
    gate_up_bias: np.ndarray | None  # [experts, 2 * intermediate]
    down_bias: np.ndarray | None  # [experts, hidden]


@dataclass(frozen=True, slots=True)
class NumpyStep:
    """One packed step as the numpy ops consume it."""

    token_ids: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    logits_indices: np.ndarray  # [S]
    cos: np.ndarray  # [T, head_dim // 2]
    sin: np.ndarray  # [T, head_dim // 2]
    attention: AttentionPlan
    lora_slots: np.ndarray | None = None  # [T] adapter slot per token, -1: none; None: no adapter
    prompt_rows: np.ndarray | None = None  # [P] rows whose embedding is given
    prompt_embeds: np.ndarray | None = None  # [P, hidden]
    # cos and sin of the model's further rotary tables, 1 on (ModelConfig.layer_rope).
    more_cos_sin: tuple[tuple[np.ndarray, np.ndarray], ...] = ()


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.einsum("ij,ij->i", x, x)[:, None] / np.float32(x.shape[1])
    return x * (1.0 / np.sqrt(variance + np.float32(eps))) * weight


def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE on [T, heads, head_dim] with cos/sin [T, head_dim // 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate((x1 * c - x2 * s, x2 * c + x1 * s), axis=-1)


class NumpyDecoderOps:
    def __init__(self, config: ModelConfig, quantize: str | None = None, deterministic: bool = False) -> None:
        """`quantize` ("fp8" | "int4"): float linear weights carry that quantization's error.
        `deterministic`: every product in fixed row tiles, so a row's logits do not depend
        on the rest of the batch (row_tiles.py)."""
        if config.is_moe and quantize is not None:
            raise CheckpointError(f"model_type {config.model_type!r}: quantization {quantize!r} of expert weights "
                                  "is not supported")  # fmt: skip
        self.config = config
        self.matmul = matmul_rows_numpy if deterministic else np.matmul
        self.quantize = quantize
        self.softmax_scale = config.softmax_scale
        self.k_cache: list[np.ndarray] = []
        self.v_cache: list[np.ndarray] = []
        self.host_k: list[np.ndarray] = []  # the host tier: [slots, block_size, kv_heads, head_dim] per layer
        self.host_v: list[np.ndarray] = []
        self.block_size = 0
        self.lora_slots: list[LoraAdapter | None] = []  # the adapter in each slot
        # Router statistics: the rows each layer's experts took since the last read.
        self.expert_tokens = np.zeros((config.num_layers, config.num_experts), np.int64)

    # -- the KV pool ------------------------------------------------------------------------

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        cfg = self.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = [np.zeros(shape, dtype=np.float32) for _ in range(cfg.num_layers)]
        self.v_cache = [np.zeros(shape, dtype=np.float32) for _ in range(cfg.num_layers)]
        self.block_size = block_size

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        for cache in (*self.k_cache, *self.v_cache):
            cache[dst] = cache[src]

    def allocate_host_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, *self.k_cache[0].shape[1:])
        self.host_k = [np.zeros(shape, dtype=np.float32) for _ in self.k_cache]
        self.host_v = [np.zeros(shape, dtype=np.float32) for _ in self.v_cache]

    def offload_kv_blocks(self, device_blocks: np.ndarray, host_slots: np.ndarray) -> None:
        for pool, host in zip((*self.k_cache, *self.v_cache), (*self.host_k, *self.host_v), strict=True):
            host[host_slots] = pool[device_blocks]

    def load_kv_blocks(self, host_slots: np.ndarray, device_blocks: np.ndarray) -> None:
        for pool, host in zip((*self.k_cache, *self.v_cache), (*self.host_k, *self.host_v), strict=True):
            pool[device_blocks] = host[host_slots]

    # -- weights ----------------------------------------------------------------------------

    def norm_weight(self, tensor: np.ndarray) -> np.ndarray:
        return tensor

    def head_weight(self, tensor: np.ndarray) -> np.ndarray:
        return tensor

    def embedding_weight(self, tensor: np.ndarray) -> np.ndarray:
        return tensor

    def lm_head_weight(self, tensor: np.ndarray) -> np.ndarray:
        return tensor.T

    def linear_weight(
        self, parts: Sequence[np.ndarray | QuantizedWeight], bias: Sequence[np.ndarray] | None, role: LinearRole
    ) -> NumpyLinear:
        # Quantized weights compute in float32 here, dequantized (the reference).
        floats = reference_parts(parts, self.quantize)
        fused = floats[0] if len(floats) == 1 else np.concatenate(floats)
        fused_bias = None if bias is None else np.concatenate(bias)
        return NumpyLinear(np.ascontiguousarray(fused.T), fused_bias, fp8_inputs(parts, self.quantize))

    def expert_weights(self, tensors: ExpertTensors) -> NumpyExperts:
        def stacked(parts: Sequence[Any]) -> np.ndarray:
            return np.stack([np.asarray(p, dtype=np.float32) for p in parts])

        gate_up = np.concatenate([stacked(tensors.gate), stacked(tensors.up)], axis=1)  # [E, 2I, hidden]
        bias = None
        if tensors.gate_bias is not None and tensors.up_bias is not None:
            bias = np.concatenate([np.asarray(tensors.gate_bias), np.asarray(tensors.up_bias)], axis=1)
        return NumpyExperts(
            router=np.ascontiguousarray(np.asarray(tensors.router, np.float32).T),
            router_bias=None if tensors.router_bias is None else np.asarray(tensors.router_bias, np.float32),
            gate_up=np.ascontiguousarray(gate_up.transpose(0, 2, 1)),
            down=np.ascontiguousarray(stacked(tensors.down).transpose(0, 2, 1)),
            gate_up_bias=bias,
            down_bias=None if tensors.down_bias is None else np.asarray(tensors.down_bias, np.float32),
        )

    # -- one step ---------------------------------------------------------------------------

    def embedding(self, table: np.ndarray, step: NumpyStep) -> np.ndarray:
        if step.prompt_rows is None:
            return table[step.token_ids]
        x = table[np.minimum(step.token_ids, table.shape[0] - 1)]  # prompt-tuning ids are past the table
        x[step.prompt_rows] = step.prompt_embeds
        return x

    def lora(self, y: np.ndarray, x: np.ndarray, layer: int, role: LinearRole, step: NumpyStep,
             logits_rows: bool) -> np.ndarray:
        """The reference: one (x @ A.T) @ B.T per adapter the rows use."""
        if step.lora_slots is None:
            return y
        slots = step.lora_slots[step.logits_indices] if logits_rows else step.lora_slots
        for slot in np.unique(slots[slots >= 0]).tolist():
            adapter = self.lora_slots[slot]
            w = None if adapter is None else adapter.weights.get((layer, role))
            if w is not None:
                rows = np.flatnonzero(slots == slot)
                a, b = w.a.reshape(-1, w.a.shape[2]), w.b.reshape(w.b.shape[0], -1)
                y[rows] += self.matmul(self.matmul(x[rows], a.T), b.T)
        return y

    def add_rms_norm(
        self, x: np.ndarray, residual: np.ndarray | None, weight: np.ndarray, eps: float
    ) -> tuple[np.ndarray, np.ndarray]:
        # The residual is always an array of the forward's own (a gather, or this sum).
        if residual is None:
            residual = x
        else:
            residual += x
        return _rms_norm(residual, weight, eps), residual

    def linear(self, x: np.ndarray, weight: NumpyLinear) -> np.ndarray:
        if weight.fp8_inputs is not None:
            x = fake_quantize_inputs(x, weight.fp8_inputs)
        y = self.matmul(x, weight.weight)
        if weight.bias is not None:
            y += weight.bias
        return y

    def head_norm(self, qkv: np.ndarray, q_weight: np.ndarray, k_weight: np.ndarray, eps: float) -> np.ndarray:
        cfg = self.config
        d = cfg.head_dim
        q_end, k_end = cfg.num_heads * d, (cfg.num_heads + cfg.num_kv_heads) * d
        t = qkv.shape[0]
        qkv[:, :q_end] = _rms_norm(qkv[:, :q_end].reshape(-1, d), q_weight, eps).reshape(t, -1)
        qkv[:, q_end:k_end] = _rms_norm(qkv[:, q_end:k_end].reshape(-1, d), k_weight, eps).reshape(t, -1)
        return qkv

    def rope_and_cache(self, qkv: np.ndarray, layer: int, rope: int, step: NumpyStep) -> np.ndarray:
        cfg = self.config
        n_heads, n_kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_end, k_end = n_heads * d, (n_heads + n_kv) * d
        t = qkv.shape[0]
        cos, sin = (step.cos, step.sin) if rope == 0 else step.more_cos_sin[rope - 1]
        q = _apply_rope(qkv[:, :q_end].reshape(t, n_heads, d), cos, sin)
        k = _apply_rope(qkv[:, q_end:k_end].reshape(t, n_kv, d), cos, sin)
        v = qkv[:, k_end:].reshape(t, n_kv, d)
        self.k_cache[layer].reshape(-1, n_kv, d)[step.slot_mapping] = k
        self.v_cache[layer].reshape(-1, n_kv, d)[step.slot_mapping] = v
        return q

    def attention(self, q: np.ndarray, layer: int, window: int | None, step: NumpyStep,
                  sinks: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
        out = paged_attention_numpy(q, self.k_cache[layer], self.v_cache[layer], step.attention, window,
                                    self.softmax_scale, self.config.attn_logit_softcap, sinks)  # fmt: skip
        return out.reshape(q.shape[0], -1)

    def glu(self, x: np.ndarray, weight: NumpyLinear, layer: int, step: NumpyStep,
            logits_rows: bool) -> np.ndarray:  # fmt: skip
        gate_up = self.lora(self.linear(x, weight), x, layer, "gate_up", step, logits_rows)
        n = gate_up.shape[1] // 2
        gate, up = gate_up[:, :n], gate_up[:, n:]
        if self.config.hidden_act == "gelu_pytorch_tanh":
            inner = np.float32(math.sqrt(2.0 / math.pi)) * (gate + np.float32(0.044715) * gate**3)
            return np.float32(0.5) * gate * (np.float32(1.0) + np.tanh(inner)) * up
        act = np.exp(-gate)  # silu(g) = g / (1 + exp(-g)), then * up, in one buffer
        act += 1.0
        np.divide(gate, act, out=act)
        act *= up
        return act

    def moe(self, x: np.ndarray, experts: NumpyExperts, layer: int, step: NumpyStep,
            logits_rows: bool) -> np.ndarray:  # fmt: skip
        logits = self.matmul(x, experts.router)
        if experts.router_bias is not None:
            logits += experts.router_bias
        chosen, weights = route(logits, self.config)  # [N, k] each
        self.expert_tokens[layer] += np.bincount(chosen.ravel(), minlength=self.config.num_experts)
        out = np.zeros_like(x)
        for e in np.unique(chosen).tolist():
            rows, k = np.nonzero(chosen == e)  # a row takes an expert at most once
            gate_up = self.matmul(x[rows], experts.gate_up[e])
            if experts.gate_up_bias is not None:
                gate_up += experts.gate_up_bias[e]
            y = self.matmul(expert_act(gate_up, self.config.expert_act), experts.down[e])
            if experts.down_bias is not None:
                y += experts.down_bias[e]
            out[rows] += y * weights[rows, k, None]
        return out

    def scale(self, x: np.ndarray, factor: float) -> np.ndarray:
        x *= np.float32(factor)
        return x

    def soft_cap(self, logits: np.ndarray, cap: float) -> np.ndarray:
        logits /= np.float32(cap)
        np.tanh(logits, out=logits)
        logits *= np.float32(cap)
        return logits

    def logits_rows(self, x: np.ndarray, step: NumpyStep) -> np.ndarray:
        return x[step.logits_indices]

    def lm_head(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return np.asarray(self.matmul(x, weight), dtype=np.float32)
