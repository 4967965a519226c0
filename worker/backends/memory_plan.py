"""Device memory the torch backend keeps out of the KV cache, by what holds it.

The KV cache gets what is left of free device memory once these are set aside.
Each term scales with the limit that bounds it: the forward's activations with
the step's token budget (max_num_tokens), the logits and the sampler's work on
them with the rows sampled in one step (at most one per sequence of the batch, and
never more than the token budget), the CUDA-graph pool with the largest graphed
batch. Sized from the wrong limit, a term either starves the cache or runs the
device out of memory mid-run.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.models.config import ModelConfig

# cuBLAS and Triton workspaces, the decode-attention split buffers, allocator slack.
FIXED_RESERVE_BYTES = 1 << 30
# Rows the sampler works on at once when rows are sampled (temperature > 0); its float64
# workspace per row is bounded by this many rows however large the batch.
SAMPLE_CHUNK_ROWS = 128
# Per logit of every sampled row: the bf16 lm_head output and its float32 copy, the
# float32 copy penalties and bans make, log-softmax / logsumexp temporaries, and a top-N
# request's stable sort (float32 values + int64 indices).
_BYTES_PER_LOGIT = 2 + 4 + 4 + 4 + 12
# Per logit of a row under temperature sampling: float64 scaled logits, sorted values and
# their int64 indices, probabilities, cumulative sums, and one masked copy in flight.
_BYTES_PER_SAMPLED_LOGIT = 6 * 8


def _per_token_activation_bytes(config: ModelConfig, dtype_bytes: int) -> int:
    """One token's live activations at the widest point of a layer: the residual stream
    and norm output, the fused qkv projection, the attention output, and the gate_up
    product with its SiLU * up result."""
    width = config.hidden_size * 4 + (config.num_heads + 2 * config.num_kv_heads) * config.head_dim * 2
    width += config.intermediate_size * 3
    return width * dtype_bytes


@dataclass(frozen=True, slots=True)
class WorkingMemory:
    """Bytes set aside outside the KV cache."""

    activations: int  # one forward over max_num_tokens tokens
    sampling: int  # one step's logits and the sampler's workspace over them
    graphs: int  # the CUDA-graph pool: the shared logits buffer and the largest graph's activations
    fixed: int

    @property
    def total(self) -> int:
        return self.activations + self.sampling + self.graphs + self.fixed

    def describe(self) -> str:
        parts = [("activations", self.activations), ("logits + sampling", self.sampling),
                 ("CUDA graphs", self.graphs), ("fixed", self.fixed)]  # fmt: skip
        return ", ".join(f"{name} {gib(n)}" for name, n in parts)


def plan_working_memory(
    config: ModelConfig, vocab_size: int, dtype_bytes: int, *, max_num_tokens: int, max_batch_size: int,
    graph_batch: int,
) -> WorkingMemory:
    """`config`: the layers this device runs (a tensor-parallel rank's shard of the heads);
    `vocab_size`: the logits' width; `graph_batch`: the largest batch captured in a CUDA
    graph (0: no graphs)."""
    per_token = _per_token_activation_bytes(config, dtype_bytes)
    rows = min(max_batch_size, max_num_tokens)
    vocab = vocab_size
    sampling = rows * vocab * _BYTES_PER_LOGIT + min(rows, SAMPLE_CHUNK_ROWS) * vocab * _BYTES_PER_SAMPLED_LOGIT
    # Every graph writes its float32 logits into one shared buffer; the pool keeps what the
    # largest graph's forward needs: its activations and the bf16 logits with their float32 copy.
    graphs = graph_batch * (vocab * 4 + vocab * (2 + 4) + per_token) if graph_batch else 0
    return WorkingMemory(activations=max_num_tokens * per_token, sampling=sampling, graphs=graphs,
                         fixed=FIXED_RESERVE_BYTES)  # fmt: skip


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
