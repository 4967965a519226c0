"""Attention over the paged KV cache in float32 numpy: the numpy backend's twin of
paged_attention.py.

Generation tokens (one per sequence) are attended all at once: their block tables gather
the cache into a dense [B, L, kv_heads, head_dim] copy with one `np.take` (faster than
fancy indexing), followed by a batched masked softmax. A multi-token chunk is attended
per sequence, as one causal-masked matmul. The new tokens' K and V must already be in the
cache. A step's plan (which tokens go together) is made once and serves every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from worker.backends.base import ForwardBatch

# Bounds on the temporaries of attention, in float32 elements: the K (and V) gathered
# for one group of generation tokens, and the score matrix of one tile of a chunk.
GATHER_BUDGET = 1 << 24
SCORE_BUDGET = 1 << 24
# Below this many padded keys a group is cheaper than the per-group overhead of another.
_MIN_SPLIT_KEYS = 16384


@dataclass(slots=True)
class DecodeGroup:
    """Sequences with one new token each, attended together."""

    rows: np.ndarray  # [B] token row of each sequence's token
    block_tables: np.ndarray  # [B, nblk] only the blocks in use
    positions: np.ndarray  # [B]


@dataclass(slots=True)
class Chunk:
    """A sequence with several new tokens (a context chunk), attended on its own."""

    start: int
    end: int
    block_table: np.ndarray  # [nblk]
    positions: np.ndarray  # [n]


@dataclass(slots=True)
class AttentionPlan:
    groups: list[DecodeGroup]
    chunks: list[Chunk]
    block_size: int
    # Additive masks per sliding window (None: full attention), made on first use.
    masks: dict[int | None, tuple[list[np.ndarray], list[np.ndarray]]] = field(default_factory=dict)

    def masks_for(self, window: int | None) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if window not in self.masks:
            bs = self.block_size
            # [B, 1, 1, L]: broadcast over kv heads and the query heads that share each
            groups = [_key_mask(g.positions, g.block_tables.shape[1] * bs, window)[:, None, None] for g in self.groups]
            chunks = [_key_mask(c.positions, c.block_table.shape[0] * bs, window) for c in self.chunks]
            self.masks[window] = (groups, chunks)
        return self.masks[window]


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


def plan(batch: ForwardBatch, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
         per_token: bool = False) -> AttentionPlan:  # fmt: skip
    """`per_token`: every token attended on its own over exactly its visible blocks, so its
    result depends on nothing but its sequence and position (not on batch-mates, nor on
    how the scheduler cut the prompt into chunks, nor on a recompute after preemption)."""
    if per_token:
        return _per_token_plan(batch, block_size)
    q_lens = np.diff(batch.query_start)
    starts = batch.query_start[:-1]
    bs = block_size
    decode = np.flatnonzero(q_lens == 1)
    # Shortest first, so each group gathers little padding past its sequences' ends.
    decode = decode[np.argsort(batch.context_lens[decode], kind="stable")]
    groups = []
    max_keys = max(1, GATHER_BUDGET // (num_kv_heads * head_dim))
    for members in _split_by_length(batch.context_lens[decode], max_keys):
        seqs = decode[members]
        nblk = int(-(-batch.context_lens[seqs].max() // bs))
        rows = starts[seqs]
        groups.append(DecodeGroup(rows, batch.block_tables[seqs, :nblk], batch.positions[rows]))
    chunks = []
    for i in np.flatnonzero(q_lens > 1):
        begin, end = int(starts[i]), int(starts[i] + q_lens[i])
        # Query tiles bound the [heads, tile, keys] score matrix; early tiles see fewer keys.
        tile = max(1, SCORE_BUDGET // (num_heads * int(batch.context_lens[i])))
        for a in range(begin, end, tile):
            b = min(a + tile, end)
            positions = batch.positions[a:b]
            nblk = int(positions[-1]) // bs + 1
            chunks.append(Chunk(a, b, batch.block_tables[i, :nblk], positions))
    return AttentionPlan(groups, chunks, block_size)


def _per_token_plan(batch: ForwardBatch, block_size: int) -> AttentionPlan:
    seq_of_token = np.repeat(np.arange(len(batch.context_lens)), np.diff(batch.query_start))
    groups = [DecodeGroup(np.array([t]), batch.block_tables[seq, None, : int(pos) // block_size + 1],
                          batch.positions[t : t + 1])
              for t, (seq, pos) in enumerate(zip(seq_of_token, batch.positions, strict=True))]  # fmt: skip
    return AttentionPlan(groups, [], block_size)


def _softmax_inplace(scores: np.ndarray, sinks: np.ndarray | None) -> np.ndarray:
    """`sinks` (broadcasting to scores[..., :1]): a logit more in each denominator."""
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks)
    scores -= top
    np.exp(scores, out=scores)
    denominator = scores.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denominator += np.exp(sinks - top)
    scores /= denominator
    return scores


def paged_attention_numpy(
    q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, plan: AttentionPlan, window: int | None, scale: float,
    softcap: float | None = None, sinks: np.ndarray | None = None,
) -> np.ndarray:
    """q [T, H, D]; caches [num_blocks, block_size, KVH, D] -> [T, H, D]. `softcap`: the
    scores become softcap * tanh(scores / softcap) before the mask. `sinks` [H]: a logit
    per head in each softmax's denominator that weights no value."""
    group_masks, chunk_masks = plan.masks_for(window)
    out = np.empty(q.shape, dtype=np.float32)
    for group, mask in zip(plan.groups, group_masks, strict=True):
        out[group.rows] = _attend_decode(q[group.rows], k_cache, v_cache, group.block_tables, mask, scale, softcap,
                                        sinks)
    for chunk, mask in zip(plan.chunks, chunk_masks, strict=True):
        out[chunk.start : chunk.end] = _attend_chunk(
            q[chunk.start : chunk.end], k_cache, v_cache, chunk.block_table, mask, scale, softcap, sinks
        )
    return out


def _cap(scores: np.ndarray, softcap: float | None) -> None:
    if softcap is not None:
        scores /= np.float32(softcap)
        np.tanh(scores, out=scores)
        scores *= np.float32(softcap)


def _attend_decode(
    q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray, mask: np.ndarray, scale: float,
    softcap: float | None, sinks: np.ndarray | None,
) -> np.ndarray:
    b, num_heads, d = q.shape
    n_kv = k_cache.shape[2]
    num_keys = block_tables.shape[1] * k_cache.shape[1]
    # [B, nblk, bs, kv, d] -> [B, kv, L, d]
    keys = np.take(k_cache, block_tables, axis=0).reshape(b, num_keys, n_kv, d).transpose(0, 2, 1, 3)
    values = np.take(v_cache, block_tables, axis=0).reshape(b, num_keys, n_kv, d).transpose(0, 2, 1, 3)
    qg = q.reshape(b, n_kv, num_heads // n_kv, d) * np.float32(scale)
    scores = np.matmul(qg, keys.transpose(0, 1, 3, 2))  # [B, kv, g, L]
    _cap(scores, softcap)
    scores += mask
    probs = _softmax_inplace(scores, None if sinks is None else sinks.reshape(1, n_kv, -1, 1))
    return np.matmul(probs, values).reshape(b, num_heads, d)


def _attend_chunk(
    q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray, mask: np.ndarray, scale: float,
    softcap: float | None, sinks: np.ndarray | None,
) -> np.ndarray:
    n, num_heads, d = q.shape
    n_kv = k_cache.shape[2]
    num_keys = block_table.shape[0] * k_cache.shape[1]
    keys = np.take(k_cache, block_table, axis=0).reshape(num_keys, n_kv, d).transpose(1, 0, 2)  # [kv, L, d]
    values = np.take(v_cache, block_table, axis=0).reshape(num_keys, n_kv, d).transpose(1, 0, 2)
    qg = (q * np.float32(scale)).reshape(n, n_kv, num_heads // n_kv, d).transpose(1, 2, 0, 3)  # [kv, g, n, d]
    scores = np.matmul(qg, keys[:, None].transpose(0, 1, 3, 2))  # [kv, g, n, L]
    _cap(scores, softcap)
    scores += mask
    probs = _softmax_inplace(scores, None if sinks is None else sinks.reshape(n_kv, -1, 1, 1))
    out = np.matmul(probs, values[:, None])  # [kv, g, n, d]
    return out.transpose(2, 0, 1, 3).reshape(n, num_heads, d)
