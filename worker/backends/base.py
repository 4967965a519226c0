"""What every backend implements: one forward over a packed batch on a paged KV cache,
and one batched sampling pass over the logits it produced.

The executor builds these arrays with numpy; a backend copies them to its device.
A TensorRT engine runner would be a third implementation of `Backend`: it would
bind these arrays to the engine's packed-input / paged-KV tensors and run it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from worker.models.config import ModelConfig
from worker.models.lora import LoraAdapter


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """One iteration's tokens, packed with no padding: B sequences, T tokens.

    Context chunks and generation tokens mix freely; sequence i owns
    token_ids[query_start[i]:query_start[i + 1]].
    """

    token_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T] position of each token in its sequence
    query_start: np.ndarray  # int64 [B + 1] cumulative token offsets
    context_lens: np.ndarray  # int64 [B] KV length of each sequence after this step
    block_tables: np.ndarray  # int64 [B, max_blocks] physical block ids, padded with 0
    slot_mapping: np.ndarray  # int64 [T] flat KV slot (block * block_size + offset) per token
    logits_indices: np.ndarray  # int64 [S] rows of T whose logits are wanted
    # LoRA: the device adapter slot of each token, -1 for none (LoraBackend.load_lora_slot);
    # None when no token of the step has an adapter.
    lora_slots: np.ndarray | None = None  # int64 [T]
    # Prompt tuning: rows of T whose embedding is given instead of looked up (their
    # token ids are >= vocab_size and stand for nothing in the vocabulary).
    prompt_rows: np.ndarray | None = None  # int64 [P]
    prompt_embeds: np.ndarray | None = None  # float32 [P, hidden]

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Per-row sampling parameters for the S rows of logits, as arrays."""

    temperature: np.ndarray  # float32 [S]; 0 means greedy
    top_k: np.ndarray  # int64 [S]; 0 means off
    top_p: np.ndarray  # float32 [S]; 1 means off
    min_p: np.ndarray  # float32 [S]; 0 means off
    # One uniform draw in [0, 1) per row, derived from (request seed, step) on the
    # host, so a request's draw never depends on what it is batched with.
    uniform: np.ndarray  # float64 [S]
    # (row, token) pairs whose logits are forced to -inf (min_tokens, bad words).
    ban_rows: np.ndarray  # int64 [N]
    ban_tokens: np.ndarray  # int64 [N]
    # The rest is off by default. A backend's sampler must honour every field
    # that is set (the torch sampler and the numpy reference apply the same rules),
    # in this order, before the rules above: bias, penalties, bans and mask.
    #
    # Embedding bias, added to the logits of some rows.
    bias_rows: np.ndarray | None = None  # int64 [R]
    bias: np.ndarray | None = None  # float32 [R, vocab]
    # Per-row penalties (None: all off) over the tokens each row has seen, given
    # as (row, token, count) triples where count is how often the row generated the
    # token (0: only in its prompt). Repetition divides a positive logit of every
    # seen token by the penalty and multiplies a negative one; presence subtracts
    # its value from tokens generated at least once; frequency subtracts its value
    # times the count.
    repetition_penalty: np.ndarray | None = None  # float32 [S]; 1 means off
    presence_penalty: np.ndarray | None = None  # float32 [S]; 0 means off
    frequency_penalty: np.ndarray | None = None  # float32 [S]; 0 means off
    seen_rows: np.ndarray | None = None  # int64 [M]
    seen_tokens: np.ndarray | None = None  # int64 [M]
    seen_counts: np.ndarray | None = None  # int64 [M]
    # Guided decoding: the tokens a grammar allows, packed 32 to an int32 word,
    # bit j of word w for token 32 * w + j (XGrammar's layout); other tokens -inf.
    mask_rows: np.ndarray | None = None  # int64 [G]
    token_mask: np.ndarray | None = None  # int32 [G, ceil(vocab / 32)]
    # How many of the most likely tokens (and their log probs) to return per row:
    # top-N log probs, and the candidates of beam search.
    top_n: int = 0

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())


@dataclass(frozen=True, slots=True)
class SampleOutput:
    token_ids: np.ndarray  # int64 [S]
    log_probs: np.ndarray  # float32 [S]: log-softmax of the processed logits at the chosen token
    # With SamplingBatch.top_n = N: the N most likely tokens of each row, most
    # likely first, and their log probs (log-softmax of the processed logits).
    top_tokens: np.ndarray | None = None  # int64 [S, N]
    top_log_probs: np.ndarray | None = None  # float32 [S, N]
    # Mixture-of-experts models: the rows each layer's experts took (its router's choices)
    # since the previous sampled step; None for dense models.
    expert_tokens: np.ndarray | None = None  # int64 [layers, experts]


class StepHandle(Protocol):
    """A step that was launched; `result` waits for its sampled tokens."""

    def result(self) -> SampleOutput | None: ...


class Backend(Protocol):
    name: str  # e.g. "numpy", "torch-cuda", "torch-cpu"
    config: ModelConfig

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V, all layers, for one token."""
        ...

    def free_memory_bytes(self) -> int:
        """Memory left for the KV cache after weights and activations."""
        ...

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """K and V per layer, laid out [num_blocks, block_size, num_kv_heads, head_dim]."""
        ...

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy whole KV blocks (copy-on-write for beams and forked sequences)."""
        ...

    def forward(self, batch: ForwardBatch) -> Any:
        """Run the model; return logits [S, vocab] for batch.logits_indices, on the device."""
        ...

    def sample(self, logits: Any, sampling: SamplingBatch) -> SampleOutput:
        """Sample one token per row; only ids and log probs come back to the host."""
        ...

    def logits_to_host(self, logits: Any) -> np.ndarray:
        """float32 copy of logits, for post-processors and requested logits outputs."""
        ...


@runtime_checkable
class LoraBackend(Backend, Protocol):
    """A backend that runs LoRA adapters: `num_slots` device slots, each holding one
    adapter of rank up to `max_rank` on every projection; a step's tokens pick their
    slot (ForwardBatch.lora_slots), so one forward mixes adapters."""

    def enable_lora(self, num_slots: int, max_rank: int) -> None:
        """Allocate the slots (zero: no adapter); before the KV cache is sized."""
        ...

    def load_lora_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Write an adapter's weights into a slot (None: clear it). Ordered after the
        steps already launched, so a slot can be rewritten while they run."""
        ...


@runtime_checkable
class HostKvBackend(Backend, Protocol):
    """A backend whose KV pool has a host tier: slots in host memory (pinned on CUDA)
    that each hold one block's K and V of every layer, in the pool's dtype. The copies
    are queued like steps: each is ordered after the steps and copies issued before it
    and before those issued after it (on CUDA they run on a side stream, and the next
    step waits on their event; the host does not wait)."""

    def allocate_host_kv_cache(self, num_blocks: int) -> None:
        """The host slots; after allocate_kv_cache."""
        ...

    def offload_kv_blocks(self, device_blocks: np.ndarray, host_slots: np.ndarray) -> None:
        """Copy device blocks (int64 [N]) into host slots (int64 [N])."""
        ...

    def load_kv_blocks(self, host_slots: np.ndarray, device_blocks: np.ndarray) -> None:
        """Copy host slots (int64 [N]) into device blocks (int64 [N])."""
        ...


@runtime_checkable
class AsyncBackend(Backend, Protocol):
    """A backend that queues a step on its device and returns at once, so the
    executor can prepare the next step meanwhile. In `batch.token_ids`, an id
    -(k + 1) stands for row k of the previous launch's sampled tokens, which the
    host has not seen yet."""

    def launch(self, batch: ForwardBatch, sampling: SamplingBatch | None) -> StepHandle: ...


@runtime_checkable
class HiddenStateBackend(Backend, Protocol):
    """A backend that can hand back the model's final hidden state instead of logits
    (what embeddings pool, worker/executor/embeddings.py)."""

    def hidden_states(self, batch: ForwardBatch) -> np.ndarray:
        """Run the model; return float32 [S, hidden] on the host: the final hidden state
        (after the last norm, before the lm head) of batch.logits_indices. Synchronous."""
        ...
