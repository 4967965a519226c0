"""The CPU reference backend: a Llama-family decoder in float32 numpy over a paged KV cache.

One forward runs a packed batch (context chunks and generation tokens together).
Each layer writes the new tokens' K/V into their cache slots first, then every token
attends to its own sequence's cached keys at positions <= its own. Generation tokens
(one per sequence) are attended all at once: their block tables gather the cache into a
dense [B, L, kv_heads, head_dim] copy with one `np.take` (faster than fancy indexing),
followed by a batched masked softmax. A multi-token chunk is attended per sequence, as
one causal-masked matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from worker.backends.base import ForwardBatch, SampleOutput, SamplingBatch
from worker.backends.numpy_sampler import sample
from worker.models.config import ModelConfig
from worker.models.loaded_model import LoadedModel
from worker.models.rope import Rope

# Bounds on the temporaries of attention, in float32 elements: the K (and V) gathered
# for one group of generation tokens, and the score matrix of one tile of a chunk.
GATHER_BUDGET = 1 << 24
SCORE_BUDGET = 1 << 24
# Below this many padded keys a group is cheaper than the per-group overhead of another.
_MIN_SPLIT_KEYS = 16384

# Host RAM is shared with everything else on the machine, so the KV cache is offered
# only this share of what the kernel reports as available.
_HOST_MEMORY_SHARE = 0.5


@dataclass(slots=True)
class _Layer:
    input_norm: np.ndarray  # [H]
    post_norm: np.ndarray  # [H]
    qkv: np.ndarray  # [H, (heads + 2 * kv_heads) * head_dim], so x @ qkv is one GEMM
    qkv_bias: np.ndarray | None
    o: np.ndarray  # [heads * head_dim, H]
    gate_up: np.ndarray  # [H, 2 * intermediate]
    down: np.ndarray  # [intermediate, H]
    window: int | None  # sliding window, None for full attention


@dataclass(slots=True)
class _DecodeGroup:
    """Sequences with one new token each, attended together."""

    rows: np.ndarray  # [B] token row of each sequence's token
    block_tables: np.ndarray  # [B, nblk] only the blocks in use
    positions: np.ndarray  # [B]


@dataclass(slots=True)
class _Chunk:
    """A sequence with several new tokens (a context chunk), attended on its own."""

    start: int
    end: int
    block_table: np.ndarray  # [nblk]
    positions: np.ndarray  # [n]


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.einsum("ij,ij->i", x, x)[:, None] / np.float32(x.shape[1])
    return x * (1.0 / np.sqrt(variance + np.float32(eps))) * weight


def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE on [T, heads, head_dim] with cos/sin [T, head_dim // 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate((x1 * c - x2 * s, x2 * c + x1 * s), axis=-1)


def _softmax_inplace(scores: np.ndarray) -> np.ndarray:
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def _key_mask(positions: np.ndarray, num_keys: int, window: int | None) -> np.ndarray:
    """Additive mask [..., num_keys]: 0 where key j is visible from a query at `positions`."""
    keys = np.arange(num_keys)
    visible = keys <= positions[..., None]
    if window is not None:
        visible &= keys > positions[..., None] - window
    return np.where(visible, np.float32(0.0), np.float32(-np.inf))


def _split_by_length(lengths: np.ndarray, max_keys: int) -> list[np.ndarray]:
    """Split ascending context lengths into groups to attend together. A group pads every
    member to its longest, so it closes before a member that would take the gather past
    max_keys, or that is over twice as long as its first member once padding is worth a
    group's fixed cost."""
    groups, first = [], 0
    for i in range(1, len(lengths) + 1):
        if i < len(lengths):
            padded = (i - first + 1) * int(lengths[i])
            longer = lengths[i] > 2 * lengths[first] and padded > _MIN_SPLIT_KEYS
            if padded <= max_keys and not longer:
                continue
        groups.append(np.arange(first, i))
        first = i
    return groups


class NumpyBackend:
    name = "numpy"

    def __init__(self, model: LoadedModel) -> None:
        cfg = model.config
        self.config: ModelConfig = cfg
        self.rope = Rope(cfg)
        w = model.weights
        self.embed = w["model.embed_tokens.weight"]
        # The head stays a transposed view: no copy of the (often largest) matrix.
        self.lm_head_t = (self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]).T
        self.final_norm = w["model.norm.weight"]
        self.layers = [self._layer(w, i) for i in range(cfg.num_layers)]
        self.scale = np.float32(cfg.head_dim**-0.5)
        self.k_cache: list[np.ndarray] = []
        self.v_cache: list[np.ndarray] = []
        self.block_size = 0

    def _layer(self, w: dict[str, np.ndarray], i: int) -> _Layer:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        bias = None
        if self.config.attention_bias:
            bias = np.concatenate([w[attn + f"{n}_proj.bias"] for n in "qkv"])
        cfg = self.config
        return _Layer(
            input_norm=w[p + "input_layernorm.weight"],
            post_norm=w[p + "post_attention_layernorm.weight"],
            qkv=np.ascontiguousarray(np.concatenate([w[attn + f"{n}_proj.weight"] for n in "qkv"]).T),
            qkv_bias=bias,
            o=np.ascontiguousarray(w[attn + "o_proj.weight"].T),
            gate_up=np.ascontiguousarray(np.concatenate([w[mlp + "gate_proj.weight"], w[mlp + "up_proj.weight"]]).T),
            down=np.ascontiguousarray(w[mlp + "down_proj.weight"].T),
            window=cfg.sliding_window if i in cfg.sliding_layers else None,
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
        cfg = self.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = [np.zeros(shape, dtype=np.float32) for _ in range(cfg.num_layers)]
        self.v_cache = [np.zeros(shape, dtype=np.float32) for _ in range(cfg.num_layers)]
        self.block_size = block_size

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        for cache in (*self.k_cache, *self.v_cache):
            cache[dst] = cache[src]

    # --- forward ----------------------------------------------------------------------

    def _plan(self, batch: ForwardBatch) -> tuple[list[_DecodeGroup], list[_Chunk]]:
        q_lens = np.diff(batch.query_start)
        starts = batch.query_start[:-1]
        bs = self.block_size
        decode = np.flatnonzero(q_lens == 1)
        # Shortest first, so each group gathers little padding past its sequences' ends.
        decode = decode[np.argsort(batch.context_lens[decode], kind="stable")]
        groups = []
        max_keys = max(1, GATHER_BUDGET // (self.config.num_kv_heads * self.config.head_dim))
        for members in _split_by_length(batch.context_lens[decode], max_keys):
            seqs = decode[members]
            nblk = int(-(-batch.context_lens[seqs].max() // bs))
            rows = starts[seqs]
            groups.append(_DecodeGroup(rows, batch.block_tables[seqs, :nblk], batch.positions[rows]))
        chunks = []
        for i in np.flatnonzero(q_lens > 1):
            begin, end = int(starts[i]), int(starts[i] + q_lens[i])
            # Query tiles bound the [heads, tile, keys] score matrix; early tiles see fewer keys.
            tile = max(1, SCORE_BUDGET // (self.config.num_heads * int(batch.context_lens[i])))
            for a in range(begin, end, tile):
                b = min(a + tile, end)
                positions = batch.positions[a:b]
                nblk = int(positions[-1]) // bs + 1
                chunks.append(_Chunk(a, b, batch.block_tables[i, :nblk], positions))
        return groups, chunks

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        if not self.k_cache:
            raise RuntimeError("NumpyBackend.forward before allocate_kv_cache")
        cfg = self.config
        n_heads, n_kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_width, kv_width = n_heads * d, n_kv * d
        tokens = batch.num_tokens

        seq_lens = None
        if self.rope.kind == "dynamic":
            seq_lens = np.repeat(batch.context_lens, np.diff(batch.query_start))
        cos, sin = self.rope.cos_sin(batch.positions, seq_lens)
        groups, chunks = self._plan(batch)
        masks: dict[int | None, tuple[list[np.ndarray], list[np.ndarray]]] = {}

        x = self.embed[batch.token_ids]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = h @ layer.qkv
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            q = _apply_rope(qkv[:, :q_width].reshape(tokens, n_heads, d), cos, sin)
            k = _apply_rope(qkv[:, q_width : q_width + kv_width].reshape(tokens, n_kv, d), cos, sin)
            v = qkv[:, q_width + kv_width :].reshape(tokens, n_kv, d)
            k_cache, v_cache = self.k_cache[i], self.v_cache[i]
            k_cache.reshape(-1, n_kv, d)[batch.slot_mapping] = k
            v_cache.reshape(-1, n_kv, d)[batch.slot_mapping] = v

            if layer.window not in masks:
                masks[layer.window] = self._masks(groups, chunks, layer.window)
            group_masks, chunk_masks = masks[layer.window]
            attn = np.empty((tokens, n_heads, d), dtype=np.float32)
            for group, mask in zip(groups, group_masks, strict=True):
                attn[group.rows] = self._attend_decode(q[group.rows], k_cache, v_cache, group, mask)
            for chunk, mask in zip(chunks, chunk_masks, strict=True):
                attn[chunk.start : chunk.end] = self._attend_chunk(
                    q[chunk.start : chunk.end], k_cache, v_cache, chunk, mask
                )
            attn_out = attn.reshape(tokens, q_width)
            if i == last:  # past attention, only the rows whose logits are wanted matter
                x, attn_out = x[batch.logits_indices], attn_out[batch.logits_indices]
            x = x + attn_out @ layer.o

            h = _rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            gate_up = h @ layer.gate_up
            gate, up = gate_up[:, : cfg.intermediate_size], gate_up[:, cfg.intermediate_size :]
            act = np.exp(-gate)  # silu(g) = g / (1 + exp(-g)), then * up, in one buffer
            act += 1.0
            np.divide(gate, act, out=act)
            act *= up
            x = x + act @ layer.down

        h = _rms_norm(x, self.final_norm, cfg.rms_norm_eps)
        return np.asarray(h @ self.lm_head_t, dtype=np.float32)

    def _masks(
        self, groups: list[_DecodeGroup], chunks: list[_Chunk], window: int | None
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        bs = self.block_size
        # [B, 1, 1, L]: broadcast over kv heads and the query heads that share each
        group_masks = [_key_mask(g.positions, g.block_tables.shape[1] * bs, window)[:, None, None, :] for g in groups]
        chunk_masks = [_key_mask(c.positions, c.block_table.shape[0] * bs, window) for c in chunks]
        return group_masks, chunk_masks

    def _attend_decode(
        self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, group: _DecodeGroup, mask: np.ndarray
    ) -> np.ndarray:
        cfg = self.config
        n_kv, d = cfg.num_kv_heads, cfg.head_dim
        b = q.shape[0]
        g = cfg.num_heads // n_kv
        num_keys = group.block_tables.shape[1] * self.block_size
        # [B, nblk, bs, kv, d] -> [B, kv, L, d]
        keys = np.take(k_cache, group.block_tables, axis=0).reshape(b, num_keys, n_kv, d).transpose(0, 2, 1, 3)
        values = np.take(v_cache, group.block_tables, axis=0).reshape(b, num_keys, n_kv, d).transpose(0, 2, 1, 3)
        qg = q.reshape(b, n_kv, g, d) * self.scale
        scores = np.matmul(qg, keys.transpose(0, 1, 3, 2))  # [B, kv, g, L]
        scores += mask
        probs = _softmax_inplace(scores)
        return np.matmul(probs, values).reshape(b, cfg.num_heads, d)

    def _attend_chunk(
        self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, chunk: _Chunk, mask: np.ndarray
    ) -> np.ndarray:
        cfg = self.config
        n_kv, d = cfg.num_kv_heads, cfg.head_dim
        n = q.shape[0]
        g = cfg.num_heads // n_kv
        num_keys = chunk.block_table.shape[0] * self.block_size
        keys = np.take(k_cache, chunk.block_table, axis=0).reshape(num_keys, n_kv, d).transpose(1, 0, 2)  # [kv, L, d]
        values = np.take(v_cache, chunk.block_table, axis=0).reshape(num_keys, n_kv, d).transpose(1, 0, 2)
        qg = (q * self.scale).reshape(n, n_kv, g, d).transpose(1, 2, 0, 3)  # [kv, g, n, d]
        scores = np.matmul(qg, keys[:, None].transpose(0, 1, 3, 2))  # [kv, g, n, L]
        scores += mask
        probs = _softmax_inplace(scores)
        out = np.matmul(probs, values[:, None])  # [kv, g, n, d]
        return out.transpose(2, 0, 1, 3).reshape(n, cfg.num_heads, d)

    # --- sampling ---------------------------------------------------------------------

    def sample(self, logits: np.ndarray, sampling: SamplingBatch) -> SampleOutput:
        return sample(logits, sampling)

    def logits_to_host(self, logits: np.ndarray) -> np.ndarray:
        return np.asarray(logits, dtype=np.float32)
