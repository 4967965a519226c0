"""The roofline: the best a step, a sequence and an offline workload can do, given the device's
measured HBM bandwidth and GEMM rate (bench/device_rates.py) and the bytes and FLOPs a model
moves and computes (float, or quantized on load)."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from typing import Any

from worker.models.mxfp4 import BLOCK as MXFP4_BLOCK
from worker.models.quantization import INT4_GROUP_SIZE

# An MXFP4 weight's bytes: its E2M1 half byte and a share of its block's E8M0 scale byte.
MXFP4_EXPERT_BYTES = 0.5 + 1 / MXFP4_BLOCK


@dataclass(slots=True)
class Roofline:
    bandwidth: float  # bytes/s
    flops: float  # FLOP/s
    weight_bytes: int  # read once per step
    matmul_params: int  # per token, lm_head excluded
    lm_head_params: int
    kv_bytes_per_token: int  # the global layers', which read the whole context
    attn_flops_per_ctx: int  # per query token per key, in the global layers
    # Pipeline stages: one sequence's step runs them one after the other, each reading its
    # share of the bytes at one stage's bandwidth (a batch's micro-batches overlap them).
    stages: int = 1
    # FLOP/s the GPU holds under minutes of load (product_rate's sustained rate); nan: not
    # measured. The roofline's figures use `flops`; `at_sustained` the same at this rate.
    sustained_flops: float = math.nan
    # Sliding-window layers: each reads and attends over at most `window` keys.
    window: int | None = None
    window_kv_bytes_per_token: int = 0
    window_attn_flops_per_ctx: int = 0
    # Mixture of experts: `weight_bytes` and `matmul_params` leave the experts out; a step
    # reads every expert its tokens chose (expected over uniform routing: experts_read), each
    # `expert_bytes` over all MoE layers, and a token computes `experts_per_token` of them.
    experts: int = 0
    experts_per_token: int = 0
    expert_bytes: int = 0
    expert_params: int = 0

    def experts_read(self, tokens: int) -> float:
        """Distinct experts a layer's `tokens` choose, expected when each picks k of E uniformly."""
        if not self.experts:
            return 0.0
        return self.experts * (1 - (1 - self.experts_per_token / self.experts) ** tokens)

    def experts_note(self) -> str:
        """For the logs: a mixture's expert weights, all of them, and how many a token reads."""
        if not self.experts:
            return ""
        return (f" + experts {self.expert_bytes * self.experts / 1e9:.2f} GB ({self.experts_per_token} of "
                f"{self.experts} a token; a step reads those its tokens chose)")

    def clipped(self, context: float) -> float:
        """Of a query's `context` keys, those a sliding-window layer reads."""
        return context if self.window is None else min(context, self.window)

    def prefill_keys(self, prompt: float) -> float:
        """Keys summed over a prompt's queries in a sliding-window layer (prompt^2 / 2 globally)."""
        if self.window is None or prompt <= self.window:
            return prompt * prompt / 2
        return self.window * self.window / 2 + (prompt - self.window) * self.window

    def at_sustained(self) -> Roofline | None:
        return None if math.isnan(self.sustained_flops) else replace(self, flops=self.sustained_flops)

    def step_floor(self, tokens: int, sampled: int, ctx_sum: float, kv_read_tokens: float,
                   window_ctx_sum: float | None = None, window_read_tokens: float | None = None) -> float:  # fmt: skip
        """Seconds: the larger of compute and memory time for one step. `window_*`: the
        same sums with each sequence's keys clipped to the window (default: unclipped)."""
        flops: float = 2 * self.matmul_params * tokens + 2 * self.lm_head_params * sampled
        flops += 2 * self.expert_params * self.experts_per_token * tokens
        flops += self.attn_flops_per_ctx * ctx_sum
        window_ctx_sum = ctx_sum if window_ctx_sum is None else window_ctx_sum
        window_read_tokens = kv_read_tokens if window_read_tokens is None else window_read_tokens
        flops += self.window_attn_flops_per_ctx * window_ctx_sum
        memory = self.weight_bytes + self.expert_bytes * self.experts_read(tokens)
        memory += self.kv_bytes_per_token * kv_read_tokens
        memory += self.window_kv_bytes_per_token * window_read_tokens
        return max(flops / self.flops, memory / self.bandwidth)

    def decode_floor(self, context: int) -> float:
        """Seconds per token for one sequence alone: weights plus its KV, read once."""
        kv = self.kv_bytes_per_token * context + self.window_kv_bytes_per_token * self.clipped(context)
        return (self.weight_bytes + self.expert_bytes * self.experts_read(1) + kv) / self.bandwidth * self.stages

    def offline_tok_s(self, prompt: int, output: int, requests: int, batch: int) -> float:
        """Best output tokens/s: prefill at full compute, then waves of at most `batch`
        concurrent sequences decoding, each step reading all weights and the wave's KV."""
        prefill = self.step_floor(prompt * requests, requests, requests * prompt * prompt / 2, 0,
                                  requests * self.prefill_keys(prompt), 0)  # fmt: skip
        full, rest = divmod(requests, min(batch, requests))

        def wave(n: int) -> float:
            return sum(self.step_floor(n, n, n * (prompt + i), n * (prompt + i), n * self.clipped(prompt + i),
                                       n * self.clipped(prompt + i)) for i in range(output - 1))  # fmt: skip

        decode = full * wave(min(batch, requests)) + (wave(rest) if rest else 0.0)
        return requests * output / (prefill + decode)

    def max_utilization_tok_s(self, prompt: int, output: int, requests: int, batch: int, kv_tokens: int) -> float:
        """Best output tokens/s under MAX_UTILIZATION: step by step, the oldest waiting sequences
        admitted while the cache holds their tokens now (at most `batch` running), the newest
        running one dropped when the next step's tokens do not fit, and recomputed (prompt and
        generated tokens) when admitted again; each step at its floor, block rounding ignored."""
        waiting = [(i, 0) for i in range(requests)]  # (arrival, tokens generated), oldest first
        running: list[list[int]] = []  # [arrival, tokens in the cache, tokens generated]
        seconds, done = 0.0, 0
        while done < requests:
            read = sum(s[1] + 1 for s in running)  # each decodes one token this step, over its cache
            window_read = sum(self.clipped(s[1] + 1) for s in running)
            held = read
            admitted: list[list[int]] = []
            while waiting and len(running) + len(admitted) < batch:
                arrival, generated = waiting[0]
                if held + prompt + generated > kv_tokens:
                    break
                waiting.pop(0)
                admitted.append([arrival, prompt + generated, generated + 1])  # its prefill samples a token
                held += prompt + generated
            if not running and not admitted:
                raise ValueError(f"a request's {prompt + waiting[0][1]} tokens do not fit a {kv_tokens}-token cache")
            computed = sum(s[1] for s in admitted)
            seconds += self.step_floor(len(running) + computed, len(running) + len(admitted),
                                       read + sum(s[1] ** 2 / 2 for s in admitted), read,
                                       window_read + sum(self.prefill_keys(s[1]) for s in admitted),
                                       window_read)  # fmt: skip
            for s in running:
                s[1] += 1
                s[2] += 1
            running = sorted(running + admitted)
            done += sum(1 for s in running if s[2] == output)
            running = [s for s in running if s[2] < output]
            while running and sum(s[1] + 1 for s in running) > kv_tokens:
                arrival, _, generated = running.pop()  # the newest
                bisect.insort(waiting, (arrival, generated))
        return requests * output / seconds

    def for_schedule(self, prompt: int, output: int, requests: int, max_batch: int, kv_tokens: int,
                     policy: str) -> float:  # fmt: skip
        """Best output tokens/s of an offline workload under the capacity scheduler `policy`."""
        if policy == "max_utilization":
            return self.max_utilization_tok_s(prompt, output, requests, max_batch, kv_tokens)
        # GUARANTEED_NO_EVICT: as many at once as the cache holds at full length
        return self.offline_tok_s(prompt, output, requests, min(max_batch, requests, kv_tokens // (prompt + output)))


def roofline_for(cfg: Any, bandwidth: float, flops: float, dtype_bytes: int, stages: int = 1,
                 kv_bytes: int | None = None) -> Roofline:  # fmt: skip
    """`dtype_bytes` a weight, and a KV value unless `kv_bytes` says otherwise (an FP8 cache)."""
    matmul, expert = _params(cfg)
    lm_head = cfg.vocab_size * cfg.hidden_size  # a tied head reads the embedding: the same bytes
    return Roofline(
        bandwidth=bandwidth,
        flops=flops,
        weight_bytes=(matmul + lm_head) * dtype_bytes,
        matmul_params=matmul,
        lm_head_params=lm_head,
        stages=stages,
        **_attention(cfg, kv_bytes or dtype_bytes),
        **_experts(cfg, expert, expert * dtype_bytes),
    )


def _params(cfg: Any) -> tuple[int, int]:
    """(the projections every token computes: attention, the dense MLPs and the MoE routers;
    one expert's over all MoE layers)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attention = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
    moe_layers = len(cfg.moe_layers) if getattr(cfg, "is_moe", False) else 0
    dense = (cfg.num_layers - moe_layers) * 3 * h * cfg.intermediate_size
    router = moe_layers * h * cfg.num_experts if moe_layers else 0
    expert = moe_layers * 3 * h * cfg.moe_intermediate_size if moe_layers else 0
    return cfg.num_layers * attention + dense + router, expert


def _experts(cfg: Any, expert_params: int, expert_bytes: int) -> dict[str, Any]:
    if not expert_params:
        return {}
    return {"experts": cfg.num_experts, "experts_per_token": cfg.experts_per_token, "expert_bytes": expert_bytes,
            "expert_params": expert_params}


def _attention(cfg: Any, kv_bytes: int) -> dict[str, Any]:
    """KV bytes and attention FLOPs per token of context, the global layers' apart from the
    sliding-window layers' (which read at most the window)."""
    windowed = len(cfg.sliding_layers) if cfg.sliding_window is not None else 0
    kv_per_layer, flops_per_layer = 2 * cfg.num_kv_heads * cfg.head_dim * kv_bytes, 4 * cfg.num_heads * cfg.head_dim
    return {
        "kv_bytes_per_token": (cfg.num_layers - windowed) * kv_per_layer,
        "attn_flops_per_ctx": (cfg.num_layers - windowed) * flops_per_layer,
        "window": cfg.sliding_window if windowed else None,
        "window_kv_bytes_per_token": windowed * kv_per_layer,
        "window_attn_flops_per_ctx": windowed * flops_per_layer,
    }


def quantized_roofline(cfg: Any, quantization: str, kv_bytes: int, bandwidth: float, flops: float,
                       stages: int = 1) -> Roofline:  # fmt: skip
    """The roofline with the projections' quantized bytes: fp8 one byte a weight plus a
    float32 scale per output channel; int4 half a byte plus a float32 scale and zero per
    group (of 32 on load). The lm head stays bf16; its FLOPs are counted at `flops` too (7%
    of them)."""
    matmul, expert = _params(cfg)
    lm_head = cfg.vocab_size * cfg.hidden_size
    h, d = cfg.hidden_size, cfg.head_dim
    moe_layers = len(cfg.moe_layers) if expert else 0
    # Output channels, each with its scale: every layer's q, k, v and o; the dense MLPs' gate, up and down.
    outs = cfg.num_layers * ((cfg.num_heads + 2 * cfg.num_kv_heads) * d + h)
    outs += (cfg.num_layers - moe_layers) * (2 * cfg.intermediate_size + h)

    def stored(params: int, channels: int) -> int:
        if quantization == "fp8":
            return params + channels * 4
        return params // 2 + params // INT4_GROUP_SIZE * 8

    expert_outs = moe_layers * (2 * cfg.moe_intermediate_size + h)
    return Roofline(
        bandwidth=bandwidth,
        flops=flops,
        weight_bytes=stored(matmul, outs) + lm_head * 2,
        matmul_params=matmul,
        lm_head_params=lm_head,
        stages=stages,
        **_attention(cfg, kv_bytes),
        **_experts(cfg, expert, stored(expert, expert_outs)),
    )


def roofline_of(cfg: Any, quantization: str | None, dtype_bytes: int, bandwidth: float, flops: float, stages: int = 1,
                kv_cache_dtype: str | None = None, expert_dtype: str = "bf16") -> Roofline:  # fmt: skip
    """The roofline of a float model (`dtype_bytes` a weight and a KV value) or of one
    quantized on load (a bf16 KV cache); an FP8 KV cache reads one byte a KV value.
    `expert_dtype` "mxfp4": the experts as packed (MXFP4_EXPERT_BYTES a weight), whatever the rest."""
    kv_bytes = 1 if kv_cache_dtype == "fp8" else None
    if quantization is None:
        roof = roofline_for(cfg, bandwidth, flops, dtype_bytes, stages, kv_bytes)
    else:
        roof = quantized_roofline(cfg, quantization, kv_bytes or 2, bandwidth, flops, stages)
    if expert_dtype == "mxfp4":
        roof = replace(roof, expert_bytes=math.ceil(roof.expert_params * MXFP4_EXPERT_BYTES))
    return roof
