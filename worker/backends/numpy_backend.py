"""The CPU reference backend: the decoder (worker.models.llama) in float32
numpy over a paged KV cache.

One forward runs a packed batch (context chunks and generation tokens together). Each
layer writes the new tokens' K/V into their cache slots first, then every token attends
to its own sequence's cached keys at positions <= its own (numpy_attention.py).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from worker.backends.base import ForwardBatch, SampleOutput, SamplingBatch
from worker.backends.numpy_attention import plan
from worker.backends.numpy_decoder_ops import NumpyDecoderOps, NumpyLinear, NumpyStep
from worker.backends.numpy_sampler import sample
from worker.models import llama
from worker.models.config import ModelConfig
from worker.models.loaded_model import LoadedModel
from worker.models.lora import LoraAdapter
from worker.models.rope import layer_ropes

# Host RAM is shared with everything else on the machine, so the KV cache is offered
# only this share of what the kernel reports as available.
_HOST_MEMORY_SHARE = 0.5


class NumpyBackend:
    name = "numpy"

    def __init__(self, model: LoadedModel, deterministic: bool = False) -> None:
        """`deterministic`: a request's logits do not depend on its batch-mates."""
        self.config: ModelConfig = model.config
        self.ropes = layer_ropes(model.config)
        self.quantization = model.quantization  # what the model runs as, for Ready and logs
        self.ops = NumpyDecoderOps(model.config, model.quantize, deterministic)
        self.deterministic = deterministic
        self.model: llama.DecoderWeights[np.ndarray, NumpyLinear] = llama.build_weights(
            model.config, {**model.weights, **model.quantized, **model.mxfp4_experts}, self.ops
        )

    # --- memory -----------------------------------------------------------------------

    def kv_bytes_per_token(self) -> int:
        cfg = self.config
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4

    def free_memory_bytes(self) -> int:
        available_kib = 0
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available_kib = int(line.split()[1])
                    break
        return int(available_kib * 1024 * _HOST_MEMORY_SHARE)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.ops.allocate_kv_cache(num_blocks, block_size)

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.ops.copy_blocks(src, dst)

    # --- the KV pool's host tier (HostKvBackend): host arrays too, copied at once ------

    def allocate_host_kv_cache(self, num_blocks: int) -> None:
        self.ops.allocate_host_kv_cache(num_blocks)

    def offload_kv_blocks(self, device_blocks: np.ndarray, host_slots: np.ndarray) -> None:
        self.ops.offload_kv_blocks(device_blocks, host_slots)

    def load_kv_blocks(self, host_slots: np.ndarray, device_blocks: np.ndarray) -> None:
        self.ops.load_kv_blocks(host_slots, device_blocks)

    # --- LoRA (LoraBackend) -----------------------------------------------------------

    def enable_lora(self, num_slots: int, max_rank: int) -> None:
        self.ops.lora_slots = [None] * num_slots  # host arrays: a slot holds the adapter itself

    def load_lora_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        self.ops.lora_slots[slot] = adapter

    # --- forward ----------------------------------------------------------------------

    def step(self, batch: ForwardBatch) -> NumpyStep:
        """The batch as the ops consume it: rotary angles and the attention plan, made once
        for every layer."""
        cfg = self.config
        cos, sin = self.ropes[0].step_cos_sin(batch.positions, batch.query_start, batch.context_lens)
        more = tuple(r.step_cos_sin(batch.positions, batch.query_start, batch.context_lens) for r in self.ropes[1:])
        attention = plan(batch, self.ops.block_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         per_token=self.deterministic)
        return NumpyStep(batch.token_ids, batch.slot_mapping, batch.logits_indices, cos, sin, attention,
                         batch.lora_slots, batch.prompt_rows, batch.prompt_embeds, more)

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        if not self.ops.k_cache:
            raise RuntimeError("NumpyBackend.forward before allocate_kv_cache")
        return llama.forward(self.model, self.ops, self.step(batch))

    def hidden_states(self, batch: ForwardBatch) -> np.ndarray:
        """HiddenStateBackend: the final hidden state [S, hidden] of batch.logits_indices."""
        if not self.ops.k_cache:
            raise RuntimeError("NumpyBackend.hidden_states before allocate_kv_cache")
        return np.asarray(llama.forward(self.model, self.ops, self.step(batch), hidden=True), dtype=np.float32)

    # --- sampling ---------------------------------------------------------------------

    def sample(self, logits: np.ndarray, sampling: SamplingBatch) -> SampleOutput:
        out = sample(logits, sampling)
        if not self.config.is_moe:
            return out
        counts = self.ops.expert_tokens.copy()
        self.ops.expert_tokens[:] = 0
        return replace(out, expert_tokens=counts)

    def logits_to_host(self, logits: np.ndarray) -> np.ndarray:
        return np.asarray(logits, dtype=np.float32)
