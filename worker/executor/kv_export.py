"""A prompt's KV blocks out of one engine core and into another (disaggregated serving).

A prefill worker reads the full blocks of a finished prompt from its prefix cache; a
decode worker writes them into free blocks of its own and registers them in its
prefix cache under the same chained hashes, so the continuation that follows finds
them there like any cached prefix and computes only the tail: the tokens past the
last full block and the first generated one. Both sides run between engine steps,
called by whoever drives the core; nothing here does I/O, and the block manager is
used through its public methods only.

Blocks imported but evicted before their continuation is scheduled (a full cache) are
simply recomputed: a transfer saves work, it never decides what is generated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from worker.executor.block_manager import BlockManager, BlockTable


class KvLayoutError(ValueError):
    """Two workers whose KV blocks cannot be exchanged; the text names the field that differs."""


@dataclass(frozen=True, slots=True)
class KvLayout:
    """What a block's bytes mean: both sides must agree on every field."""

    model: str  # the served model's name
    num_layers: int
    block_size: int  # tokens per block
    num_kv_heads: int  # on this rank
    head_dim: int
    dtype: str  # of K and V in the cache, e.g. "float32", "bfloat16", "float8_e4m3fn"
    tensor_parallel_size: int

    @property
    def bytes_per_block(self) -> int:
        """K and V, every layer."""
        per_layer = self.block_size * self.num_kv_heads * self.head_dim * _itemsize(self.dtype)
        return 2 * self.num_layers * per_layer


def check_layout(theirs: KvLayout, ours: KvLayout) -> None:
    """Raise KvLayoutError naming every field on which two layouts differ."""
    differ = [f"{name} {getattr(theirs, name)!r} (here {getattr(ours, name)!r})"
              for name in KvLayout.__dataclass_fields__ if getattr(theirs, name) != getattr(ours, name)]  # fmt: skip
    if differ:
        raise KvLayoutError(f"KV blocks of another layout: {', '.join(differ)}")


@dataclass(frozen=True, slots=True)
class KvBlocks:
    """Full KV blocks of a token prefix: `frames[i]` is block i's K and V, layer by layer
    (K of layer 0, V of layer 0, K of layer 1, ...), each [block_size, num_kv_heads,
    head_dim] in `layout.dtype`, C order."""

    layout: KvLayout
    token_ids: tuple[int, ...]  # the tokens the blocks hold: block_size per block
    frames: list[list[bytes]]

    @property
    def num_bytes(self) -> int:
        return sum(len(f) for block in self.frames for f in block)


class KvBlockStore(Protocol):
    """The backend's side: a block's K and V per layer as bytes, read and written."""

    def dtype(self) -> str: ...

    def read(self, block_id: int) -> list[bytes]: ...

    def write(self, block_id: int, frames: list[bytes]) -> None: ...


class CacheStore:
    """A KvBlockStore over the per-layer caches every backend's ops hold (`k_cache`,
    `v_cache`: numpy arrays or torch tensors, [num_blocks, block_size, kv_heads, head_dim])."""

    def __init__(self, ops: Any) -> None:
        self.k_cache: list[Any] = ops.k_cache
        self.v_cache: list[Any] = ops.v_cache

    def _layers(self) -> list[Any]:
        return [c for pair in zip(self.k_cache, self.v_cache, strict=True) for c in pair]

    def dtype(self) -> str:
        return str(self.k_cache[0].dtype).removeprefix("torch.")

    def read(self, block_id: int) -> list[bytes]:
        return [_block_bytes(cache[block_id]) for cache in self._layers()]

    def write(self, block_id: int, frames: list[bytes]) -> None:
        layers = self._layers()
        if len(frames) != len(layers):
            raise KvLayoutError(f"a block of {len(frames)} frames; this cache has {len(layers)} (K and V per layer)")
        for cache, data in zip(layers, frames, strict=True):
            _write_block(cache, block_id, data)


def store_of(backend: Any) -> CacheStore:
    """The KV cache of a backend (an engine core's `backend`)."""
    ops = getattr(backend, "ops", None)
    if ops is None or not hasattr(ops, "k_cache"):
        raise KvLayoutError(f"the {backend.name} backend keeps no KV cache to export or import")
    return CacheStore(ops)


def layout_of(blocks: BlockManager, store: CacheStore, model: str, tensor_parallel_size: int) -> KvLayout:
    k = store.k_cache[0]
    return KvLayout(
        model=model,
        num_layers=len(store.k_cache),
        block_size=blocks.block_size,
        num_kv_heads=int(k.shape[2]),
        head_dim=int(k.shape[3]),
        dtype=store.dtype(),
        tensor_parallel_size=tensor_parallel_size,
    )


def read_blocks(blocks: BlockManager, store: KvBlockStore, layout: KvLayout, token_ids: list[int]) -> KvBlocks:
    """The cached full blocks of `token_ids` but its last token (which a continuation
    computes for its logits), up to the first one in the host tier: for a finished
    prefill, its prompt and first token."""
    block_ids = []
    for hit in blocks.cached_prefix(token_ids):
        if hit.on_host:  # the rest is not on the device; the decode worker computes from there
            break
        block_ids.append(hit.where)
    covered = tuple(token_ids[: len(block_ids) * blocks.block_size])
    return KvBlocks(layout, covered, [store.read(b) for b in block_ids])


def write_blocks(blocks: BlockManager, store: KvBlockStore, layout: KvLayout, kv: KvBlocks) -> int:
    """Write `kv` into the prefix cache of `blocks`; the blocks written (those not cached
    already). Raises KvLayoutError on a layout that is not `layout`."""
    check_layout(kv.layout, layout)
    num_tokens = len(kv.token_ids)
    if num_tokens != len(kv.frames) * layout.block_size:
        raise KvLayoutError(f"{len(kv.frames)} blocks of {layout.block_size} tokens hold {num_tokens} token ids")
    if not kv.frames:
        return 0
    # One token past the blocks, so that cached_prefix may match all of them: those
    # already cached are shared, not written again.
    lookup = [*kv.token_ids, 0]
    table = BlockTable()
    cached = blocks.allocate_prompt(table, lookup, num_tokens) // layout.block_size
    try:
        for i in range(cached, len(kv.frames)):
            store.write(table.block_ids[i], kv.frames[i])
        blocks.register_full_blocks(table, kv.token_ids, num_tokens)
    finally:
        blocks.free(table)  # into the prefix cache: held by no request until one matches them
    return len(kv.frames) - cached


def _itemsize(dtype: str) -> int:
    if dtype.startswith("float8"):
        return 1
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def _block_bytes(block: Any) -> bytes:
    if isinstance(block, np.ndarray):
        return np.ascontiguousarray(block).tobytes()
    import torch  # only torch backends hold torch tensors

    return bytes(block.contiguous().view(torch.uint8).cpu().numpy().tobytes())


def _write_block(cache: Any, block_id: int, data: bytes) -> None:
    target = cache[block_id]
    if isinstance(cache, np.ndarray):
        if len(data) != target.nbytes:
            raise KvLayoutError(f"a KV frame of {len(data)} bytes; a block here is {target.nbytes}")
        cache[block_id] = np.frombuffer(data, dtype=cache.dtype).reshape(target.shape)
        return
    import torch

    raw = target.view(torch.uint8)
    if len(data) != raw.numel():
        raise KvLayoutError(f"a KV frame of {len(data)} bytes; a block here is {raw.numel()}")
    raw.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(raw.shape))
