"""The decoder's ops (worker.models.llama.DecoderOps) in torch, and the KV pool.

On CUDA: cuBLAS GEMMs (F.linear) over the fused projections, a Triton GEMV for one-row
products (batch-1 decode, gemv.py; gate_up's with SwiGLU in the same launch), and Triton
kernels for everything else: add + RMSNorm, SiLU * up, rotary embedding fused with the
KV-cache write (torch_ops.py), and attention over the paged cache (paged_attention.py,
with the score soft-cap, window and sinks of the layer);
in one-row steps these launch with programmatic dependent launch on Hopper (pdl.py). On
the CPU, or without Triton: their plain-torch twins. The variants with no kernel of their
own (q/k head norms, GeGLU, embedding scale, logit soft-cap) run as plain torch ops on
every device. Rotary angles come from a table of cos | sin rows indexed by position on
the device, one per rotary embedding the layers use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from worker.backends import gemv, invariant_matmul, paged_attention, quant_linear, torch_ops
from worker.backends.fused_moe import experts_from_float
from worker.backends.gelu_mul import gelu_tanh_mul_torch, gelu_tanh_mul_triton
from worker.backends.head_norm import head_norm_torch, head_norm_triton
from worker.backends.lora_kernel import add_lora
from worker.backends.torch_moe import TorchExperts, experts_out, mxfp4_experts, route
from worker.backends.torch_step import StepInputs
from worker.models.config import CheckpointError, ModelConfig
from worker.models.llama import LinearRole
from worker.models.lora import ROLES, LoraAdapter, role_shape
from worker.models.moe_checkpoint import ExpertTensors
from worker.models.mxfp4 import Mxfp4Tensor
from worker.models.quantization import Fp8Weight, Int4Weight, QuantizedWeight, fp8_inputs, reference_parts
from worker.models.rope import layer_ropes


def _lora_slots(step: StepInputs, logits_rows: bool) -> torch.Tensor | None:
    """The adapter slot of each row (the logits rows', past the last attention); None: no adapter."""
    return step.lora_logits_slots if logits_rows else step.lora_slots


@dataclass(frozen=True, slots=True)
class TorchLinear:
    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None  # [out]


class TorchDecoderOps:
    def __init__(
        self, config: ModelConfig, device: torch.device, dtype: torch.dtype, max_model_len: int,
        quantize: str | None = None, kv_dtype: torch.dtype | None = None, deterministic: bool = False,
    ) -> None:  # fmt: skip
        """Refuses a rope the position table cannot express (see Rope.position_table).
        `quantize` ("fp8" | "int4"): float linear weights are quantized as they are made.
        `kv_dtype`: the KV pool's (torch.float8_e4m3fn: half the bytes); default `dtype`.
        `deterministic`: float linear layers and the lm head in fixed row tiles
        (invariant_matmul.py), so a row's logits do not depend on its batch-mates."""
        self.config = config
        self.deterministic = deterministic
        self.quantize = quantize
        self.kv_dtype = kv_dtype or dtype
        self.device, self.dtype = device, dtype
        self.softmax_scale = config.softmax_scale
        self.softcap = config.attn_logit_softcap
        # One cos | sin table per rotary embedding the layers use (ModelConfig.layer_rope).
        self.cos_sin_tables = [
            torch.from_numpy(np.concatenate(rope.position_table(max_model_len), axis=1)).to(device)
            for rope in layer_ropes(config)
        ]
        self.use_triton = device.type == "cuda" and paged_attention.triton is not None
        # bf16 on CUDA: the fused expert kernel (worker/backends/fused_moe.py), which also
        # reads FP8 and packed MXFP4 expert weights; the loop elsewhere computes with float ones only.
        self.fused_experts = device.type == "cuda" and dtype == torch.bfloat16 and paged_attention.triton is not None
        if config.is_moe and quantize is not None and not (quantize == "fp8" and self.fused_experts):
            raise CheckpointError(f"model_type {config.model_type!r}: quantization {quantize!r} of expert weights "
                                  "is not supported here (FP8 experts: bf16 on CUDA)")  # fmt: skip
        # Router statistics: the rows each layer's experts took since the last read, on the device.
        self.expert_tokens = torch.zeros((config.num_layers, config.num_experts), dtype=torch.int64, device=device)

        if self.use_triton:
            self._add_rmsnorm, self._silu_mul, self._rope_cache = (
                torch_ops.add_rmsnorm_triton, torch_ops.silu_mul_triton, torch_ops.rope_and_cache_triton,
            )  # fmt: skip
        else:
            self._add_rmsnorm, self._silu_mul, self._rope_cache = (
                torch_ops.add_rmsnorm_torch, torch_ops.silu_mul_torch, torch_ops.rope_and_cache_torch,
            )  # fmt: skip
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        # LoRA slots per (layer, role): A [slots, parts * max_rank, in] and B [slots, out,
        # parts * max_rank], each part's rank zero-padded to max_rank (lora_kernel.add_lora).
        self.lora_a: dict[tuple[int, LinearRole], torch.Tensor] = {}
        self.lora_b: dict[tuple[int, LinearRole], torch.Tensor] = {}
        # FP8 projections with per-token scales (on CUDA): the norms and SwiGLU also write
        # their output's e4m3 codes and scales, kept here as (output, codes, scales) until
        # the projection that reads that output takes them.
        self.fp8_activations = False
        self._fp8_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # Where the lm head writes its logits when they are exactly its shape: a CUDA graph's
        # rows of the shared logits buffer (TorchBackend.run_model), saving a copy there.
        self.logits_out: torch.Tensor | None = None

    # -- the KV pool ------------------------------------------------------------------------

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        cfg = self.config
        self.k_cache, self.v_cache = [], []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        for _ in range(cfg.num_layers):
            self.k_cache.append(torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
            self.v_cache.append(torch.zeros(shape, dtype=self.kv_dtype, device=self.device))

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        s = torch.as_tensor(np.asarray(src, dtype=np.int64)).to(self.device)
        d = torch.as_tensor(np.asarray(dst, dtype=np.int64)).to(self.device)
        for k, v in zip(self.k_cache, self.v_cache, strict=True):
            if k.dtype == torch.float8_e4m3fn:  # copied as bytes: indexing may not take float8
                k, v = k.view(torch.uint8), v.view(torch.uint8)
            k[d] = k[s]
            v[d] = v[s]

    # -- LoRA slots -------------------------------------------------------------------------

    def allocate_lora(self, num_slots: int, max_rank: int) -> None:
        for layer in range(self.config.num_layers):
            for role in ROLES:
                width, outs = role_shape(self.config, role)
                rank = len(outs) * max_rank
                self.lora_a[layer, role] = torch.zeros((num_slots, rank, width), dtype=self.dtype, device=self.device)
                self.lora_b[layer, role] = torch.zeros((num_slots, sum(outs), rank), dtype=self.dtype,
                                                       device=self.device)  # fmt: skip

    def load_lora_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        for key, a in self.lora_a.items():
            b = self.lora_b[key]
            a[slot].zero_()
            b[slot].zero_()
            w = None if adapter is None else adapter.weights.get(key)
            if w is not None:
                parts, rank, width = w.a.shape
                a[slot].view(parts, -1, width)[:, :rank] = self._tensor(w.a)
                b[slot].view(b.shape[1], parts, -1)[:, :, :rank] = self._tensor(w.b)

    # -- weights ----------------------------------------------------------------------------

    def _tensor(self, t: torch.Tensor | np.ndarray) -> torch.Tensor:
        """On the device in the backend's dtype; the same tensor when it already is."""
        t = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
        return t.to(device=self.device, dtype=self.dtype)

    def _fused(self, parts: Sequence[torch.Tensor | np.ndarray]) -> torch.Tensor:
        if len(parts) == 1:
            return self._tensor(parts[0])
        return torch.cat([self._tensor(p) for p in parts], dim=0)

    def norm_weight(self, tensor: torch.Tensor | np.ndarray) -> torch.Tensor:
        return self._tensor(tensor)

    def head_weight(self, tensor: torch.Tensor | np.ndarray) -> torch.Tensor:
        return self._tensor(tensor)

    def embedding_weight(self, tensor: torch.Tensor | np.ndarray) -> torch.Tensor:
        return self._tensor(tensor)

    def lm_head_weight(self, tensor: torch.Tensor | np.ndarray) -> torch.Tensor:
        return self._tensor(tensor)

    def linear_weight(
        self,
        parts: Sequence[torch.Tensor | np.ndarray | QuantizedWeight],
        bias: Sequence[torch.Tensor | np.ndarray] | None,
        role: LinearRole,
    ) -> TorchLinear | quant_linear.QuantLinear:
        if self.quantize is not None or any(isinstance(p, Fp8Weight | Int4Weight) for p in parts):
            return self._quantized_linear(parts, None if bias is None else self._fused(bias))
        return TorchLinear(self._fused([p for p in parts if not isinstance(p, Fp8Weight | Int4Weight)]),
                           None if bias is None else self._fused(bias))  # fmt: skip

    def _quantized_linear(
        self, parts: Sequence[torch.Tensor | np.ndarray | QuantizedWeight], bias: torch.Tensor | None
    ) -> TorchLinear | quant_linear.QuantLinear:
        """On CUDA the FP8 / W4A16 GEMMs (quant_linear.py); on the CPU the dequantized reference."""
        if self.device.type == "cuda":
            layer = quant_linear.quantized_linear(parts, bias, self.quantize, self.device)
            if isinstance(layer, quant_linear.Fp8Linear) and layer.input_scale is None and self.use_triton:
                self.fp8_activations = True
            return layer
        host = [p if isinstance(p, Fp8Weight | Int4Weight) else torch.as_tensor(p).float().numpy() for p in parts]
        fused = self._fused(reference_parts(host, self.quantize))
        inputs = fp8_inputs(parts, self.quantize)
        if inputs is None:
            return TorchLinear(fused, bias)
        return quant_linear.Fp8Reference(fused, bias, inputs.static_scale)

    def expert_weights(self, tensors: ExpertTensors) -> TorchExperts:
        def stacked(parts: Sequence[torch.Tensor | np.ndarray]) -> torch.Tensor:
            return torch.stack([self._tensor(p) for p in parts])

        bias = None
        if tensors.gate_bias is not None and tensors.up_bias is not None:
            bias = torch.cat([self._tensor(tensors.gate_bias), self._tensor(tensors.up_bias)], dim=1)
        down_bias = None if tensors.down_bias is None else self._tensor(tensors.down_bias)
        gate_up: torch.Tensor | None = None
        down: torch.Tensor | None = None
        fused = None
        if self.fused_experts and isinstance(tensors.gate, Mxfp4Tensor):
            # Packed MXFP4 (gpt-oss) goes to the kernel as it is; elsewhere it reads as float experts.
            assert isinstance(tensors.up, Mxfp4Tensor) and isinstance(tensors.down, Mxfp4Tensor)
            fused = mxfp4_experts(tensors.gate, tensors.up, tensors.down, bias, down_bias, self.device)
        else:
            gate_up = torch.cat([stacked(tensors.gate), stacked(tensors.up)], dim=1).contiguous()
            down = stacked(tensors.down).contiguous()
            if self.fused_experts:
                fused = experts_from_float(gate_up, down, bias, down_bias, "fp8" if self.quantize == "fp8" else "bf16")
                if fused.format != "bf16":  # the float copies are the kernel's own in bf16; drop them otherwise
                    gate_up = down = None
        return TorchExperts(
            router=self._tensor(tensors.router),
            router_bias=None if tensors.router_bias is None else self._tensor(tensors.router_bias),
            gate_up=gate_up,
            down=down,
            gate_up_bias=bias,
            down_bias=down_bias,
            fused=fused,
        )

    # -- one step ---------------------------------------------------------------------------

    def embedding(self, table: torch.Tensor, step: StepInputs) -> torch.Tensor:
        if step.prompt_rows is None:
            return F.embedding(step.tokens, table)
        x = F.embedding(step.tokens.clamp(max=table.shape[0] - 1), table)  # prompt-tuning ids are past the table
        assert step.prompt_embeds is not None
        x[step.prompt_rows] = step.prompt_embeds
        return x

    def lora(self, y: torch.Tensor, x: torch.Tensor, layer: int, role: LinearRole, step: StepInputs,
             logits_rows: bool) -> torch.Tensor:
        slots = _lora_slots(step, logits_rows)
        if slots is None:
            return y
        # Triton on CUDA (no host sync: CUDA graphs capture it), the torch reference elsewhere.
        add_lora(y, x, self.lora_a[layer, role], self.lora_b[layer, role], slots)
        return y

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fp8_activations:
            out, codes, scales = torch_ops.add_rmsnorm_fp8_triton(x, residual, weight, eps)
            self._fp8_rows = (out, codes, scales)
            return out, x if residual is None else residual
        if residual is None:
            return self._add_rmsnorm(x, None, weight, eps), x
        return self._add_rmsnorm(x, residual, weight, eps), residual

    def linear(self, x: torch.Tensor, weight: TorchLinear | quant_linear.QuantLinear) -> torch.Tensor:
        if isinstance(weight, TorchLinear):
            if self.deterministic:
                return invariant_matmul.linear(x, weight.weight, weight.bias)
            if self._one_row(x, weight.weight):
                return gemv.gemv(x, weight.weight, weight.bias)
            return F.linear(x, weight.weight, weight.bias)
        if isinstance(weight, quant_linear.Fp8Linear):
            made = self._fp8_rows
            self._fp8_rows = None
            return weight(x, made[1:] if made is not None and made[0] is x else None)
        return weight(x)

    def _one_row(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return not self.deterministic and self.use_triton and x.shape[0] == 1 and weight.stride(1) == 1

    def head_norm(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> torch.Tensor:
        cfg = self.config
        norm = head_norm_triton if self.use_triton else head_norm_torch
        return norm(qkv, q_weight, k_weight, eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

    def rope_and_cache(self, qkv: torch.Tensor, layer: int, rope: int, step: StepInputs) -> torch.Tensor:
        cfg = self.config
        return self._rope_cache(
            qkv, step.positions, self.cos_sin_tables[rope], self.k_cache[layer], self.v_cache[layer], step.slots,
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
        )  # fmt: skip

    def attention(self, q: torch.Tensor, layer: int, window: int | None, step: StepInputs,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if self.use_triton:
            out = paged_attention.paged_attention_triton(
                q, self.k_cache[layer], self.v_cache[layer], step.block_tables, step.query_start, step.seq_lens,
                step.tile_seq, step.tile_q0, step.block_q, self.softmax_scale, window, splits=step.splits,
                softcap=self.softcap, sinks=sinks,
            )  # fmt: skip
        else:
            block_tables, query_start, seq_lens = step.block_tables.long(), step.query_start_host, step.seq_lens_host
            if self.deterministic:
                block_tables, query_start, seq_lens = _per_token(block_tables, query_start, seq_lens)
            out = paged_attention.paged_attention_torch(
                q, self.k_cache[layer], self.v_cache[layer], block_tables, query_start, seq_lens,
                self.softmax_scale, window, self.softcap, sinks,
            )  # fmt: skip
        return out.view(q.shape[0], -1)

    def glu(self, x: torch.Tensor, weight: TorchLinear | quant_linear.QuantLinear, layer: int, step: StepInputs,
            logits_rows: bool) -> torch.Tensor:  # fmt: skip
        if self.config.hidden_act == "gelu_pytorch_tanh":
            gate_up = self.lora(self.linear(x, weight), x, layer, "gate_up", step, logits_rows)
            return gelu_tanh_mul_triton(gate_up) if self.use_triton else gelu_tanh_mul_torch(gate_up)
        if (isinstance(weight, TorchLinear) and weight.bias is None and _lora_slots(step, logits_rows) is None
                and self._one_row(x, weight.weight)):  # fmt: skip
            return gemv.gemv_swiglu(x, weight.weight)  # one launch, no gate_up activations
        gate_up = self.lora(self.linear(x, weight), x, layer, "gate_up", step, logits_rows)
        if self.fp8_activations:
            out, codes, scales = torch_ops.silu_mul_fp8_triton(gate_up)
            self._fp8_rows = (out, codes, scales)
            return out
        return self._silu_mul(gate_up)

    def moe(self, x: torch.Tensor, experts: TorchExperts, layer: int, step: StepInputs,
            logits_rows: bool) -> torch.Tensor:  # fmt: skip
        chosen, weights = route(F.linear(x, experts.router, experts.router_bias), self.config)
        ones = torch.ones(chosen.numel(), dtype=torch.int64, device=chosen.device)
        self.expert_tokens[layer].index_add_(0, chosen.flatten(), ones)
        return experts_out(x, experts, chosen, weights, self.config.expert_act)

    def scale(self, x: torch.Tensor, factor: float) -> torch.Tensor:
        return x.mul_(float(torch.tensor(factor, dtype=x.dtype)))

    def soft_cap(self, logits: torch.Tensor, cap: float) -> torch.Tensor:
        return logits.div_(cap).tanh_().mul_(cap)  # in place: a CUDA graph's logits stay in its buffer

    def logits_rows(self, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        return x if step.logits_indices is None else x[step.logits_indices]

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.deterministic:
            return invariant_matmul.linear(x, weight, out_dtype=torch.float32)
        if self._one_row(x, weight):
            return gemv.gemv(x, weight, out_dtype=torch.float32)
        if not x.is_cuda:
            return F.linear(x, weight).float()
        # float32 straight from cuBLAS's accumulator: no bf16 logits to widen in a pass of their own.
        out = self.logits_out
        if out is not None and out.shape == (x.shape[0], weight.shape[0]):
            return torch.mm(x, weight.t(), out_dtype=torch.float32, out=out)
        return torch.mm(x, weight.t(), out_dtype=torch.float32)


def _per_token(block_tables: torch.Tensor, query_start: np.ndarray,
               seq_lens: np.ndarray) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:  # fmt: skip
    """Each token as a sequence of its own, seeing exactly the keys up to its position: its
    attention then depends on nothing but its sequence and position (not on batch-mates,
    nor on how its prompt was cut into chunks, nor on a recompute after preemption)."""
    q_lens = np.diff(query_start)
    seq_of_token = np.repeat(np.arange(len(q_lens)), q_lens)
    offset_from_end = np.repeat(query_start[1:], q_lens) - 1 - np.arange(int(query_start[-1]))
    token_lens = seq_lens[seq_of_token] - offset_from_end
    index = torch.from_numpy(seq_of_token).to(block_tables.device)
    return block_tables[index], np.arange(len(seq_of_token) + 1), token_lens
