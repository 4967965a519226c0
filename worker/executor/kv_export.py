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
from typing import Any

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
    """Full KV blocks of a token prefix in one buffer: [num_layers, 2 (K, V), num_blocks,
    block_size, num_kv_heads, head_dim] in `layout.dtype`, C order (protocol.KV_FORMAT).
    `data` is the bytes on the host, or a torch tensor of that layout's bytes on a device
    (a buffer another process shared by CUDA IPC: worker/backends/torch_kv_ipc.py)."""

    layout: KvLayout
    token_ids: tuple[int, ...]  # the tokens the blocks hold: block_size per block
    data: bytes | Any

    @property
    def num_blocks(self) -> int:
        return len(self.token_ids) // self.layout.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block


class CacheStore:
    """The per-layer caches every backend's ops hold (`k_cache`, `v_cache`: numpy arrays or
    torch tensors, [num_blocks, block_size, kv_heads, head_dim]), read and written many
    blocks at a time: one indexed copy per layer's K and V into or out of one buffer, and
    one copy between device and host, where a block at a time would take 2 x layers small
    copies per block."""

    def __init__(self, ops: Any) -> None:
        self.k_cache: list[Any] = ops.k_cache
        self.v_cache: list[Any] = ops.v_cache

    def dtype(self) -> str:
        return str(self.k_cache[0].dtype).removeprefix("torch.")

    def on_cuda(self) -> bool:
        return getattr(self.k_cache[0], "is_cuda", False) is True

    def gather(self, block_ids: list[int]) -> Any:
        """The blocks' K and V in one buffer of the KvBlocks layout, where the cache is:
        a numpy array, or a torch uint8 tensor (an FP8 cache's bytes move as they are)."""
        if isinstance(self.k_cache[0], np.ndarray):
            ids = np.asarray(block_ids, dtype=np.int64)
            return np.stack([np.stack((k[ids], v[ids])) for k, v in zip(self.k_cache, self.v_cache, strict=True)])
        return _gather_torch(self.k_cache, self.v_cache, block_ids)

    def read(self, block_ids: list[int]) -> bytes:
        """The blocks as host bytes: one gather, then one copy to the host."""
        data = self.gather(block_ids)
        if isinstance(data, np.ndarray):
            return data.tobytes()
        return bytes(data.cpu().numpy().data)

    def write(self, block_ids: list[int], data: bytes | Any, first: int = 0) -> None:
        """Write blocks `first`, `first` + 1, ... of a KvBlocks buffer (bytes, or a torch
        tensor on any device) into `block_ids`: one copy to this cache's device, one
        indexed copy per layer's K and V."""
        shape = self._shape(data)
        if not isinstance(self.k_cache[0], np.ndarray):
            _write_torch(self.k_cache, self.v_cache, block_ids, data, shape, first)
            return
        src = np.frombuffer(data, dtype=self.k_cache[0].dtype).reshape(shape)
        ids = np.asarray(block_ids, dtype=np.int64)
        for layer, (k, v) in enumerate(zip(self.k_cache, self.v_cache, strict=True)):
            k[ids] = src[layer, 0, first : first + len(ids)]
            v[ids] = src[layer, 1, first : first + len(ids)]

    def _shape(self, data: Any) -> tuple[int, ...]:
        """The KvBlocks shape of `data` in this cache's elements (bytes for a torch cache)."""
        block = self.k_cache[0][0]
        per_block = 2 * len(self.k_cache) * block.nbytes
        size = len(data) if isinstance(data, bytes | bytearray | memoryview) else data.numel() * data.element_size()
        if size % per_block:
            raise KvLayoutError(f"KV blocks of {size} bytes; a block here is {per_block} (K and V, every layer)")
        if isinstance(self.k_cache[0], np.ndarray):
            return (len(self.k_cache), 2, size // per_block, *block.shape)
        return (len(self.k_cache), 2, size // per_block, *block.shape[:-1], block.shape[-1] * block.element_size())


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


def prefix_blocks(blocks: BlockManager, token_ids: list[int]) -> list[int]:
    """The device blocks caching the full blocks of `token_ids` but its last token (which a
    continuation computes for its logits), up to the first one in the host tier: for a
    finished prefill, its prompt and first token."""
    block_ids = []
    for hit in blocks.cached_prefix(token_ids):
        if hit.on_host:  # the rest is not on the device; the decode worker computes from there
            break
        block_ids.append(hit.where)
    return block_ids


def read_blocks(blocks: BlockManager, store: CacheStore, layout: KvLayout, token_ids: list[int]) -> KvBlocks:
    """The cached full blocks of `token_ids` (prefix_blocks) as host bytes."""
    block_ids = prefix_blocks(blocks, token_ids)
    covered = tuple(token_ids[: len(block_ids) * blocks.block_size])
    return KvBlocks(layout, covered, store.read(block_ids) if block_ids else b"")


def write_blocks(blocks: BlockManager, store: CacheStore, layout: KvLayout, kv: KvBlocks) -> int:
    """Write `kv` into the prefix cache of `blocks`; the blocks written (those not cached
    already). Raises KvLayoutError on a layout that is not `layout`."""
    check_layout(kv.layout, layout)
    num_tokens = len(kv.token_ids)
    if num_tokens % layout.block_size:
        raise KvLayoutError(f"{num_tokens} token ids do not fill blocks of {layout.block_size}")
    size = len(kv.data) if isinstance(kv.data, bytes) else kv.data.numel() * kv.data.element_size()
    if size != kv.num_bytes:
        raise KvLayoutError(f"{kv.num_blocks} blocks of this layout are {kv.num_bytes} bytes; got {size}")
    if not kv.num_blocks:
        return 0
    # One token past the blocks, so that cached_prefix may match all of them: those
    # already cached are shared, not written again.
    lookup = [*kv.token_ids, 0]
    table = BlockTable()
    cached = blocks.allocate_prompt(table, lookup, num_tokens) // layout.block_size
    try:
        if cached < kv.num_blocks:
            store.write(table.block_ids[cached:], kv.data, first=cached)
        blocks.register_full_blocks(table, kv.token_ids, num_tokens)
    finally:
        blocks.free(table)  # into the prefix cache: held by no request until one matches them
    return kv.num_blocks - cached


def _itemsize(dtype: str) -> int:
    if dtype.startswith("float8"):
        return 1
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def _gather_torch(k_cache: list[Any], v_cache: list[Any], block_ids: list[int]) -> Any:
    import torch  # only torch backends hold torch tensors

    k0 = k_cache[0].view(torch.uint8)
    ids = torch.tensor(block_ids, dtype=torch.int64, device=k0.device)
    out = torch.empty((len(k_cache), 2, len(block_ids), *k0.shape[1:]), dtype=torch.uint8, device=k0.device)
    for layer, (k, v) in enumerate(zip(k_cache, v_cache, strict=True)):
        torch.index_select(k.view(torch.uint8), 0, ids, out=out[layer, 0])
        torch.index_select(v.view(torch.uint8), 0, ids, out=out[layer, 1])
    return out


def _write_torch(k_cache: list[Any], v_cache: list[Any], block_ids: list[int], data: bytes | Any,
                 shape: tuple[int, ...], first: int) -> None:  # fmt: skip
    import torch

    device = k_cache[0].device
    if isinstance(data, torch.Tensor):
        src = data.view(torch.uint8).reshape(shape)
    else:  # a writable copy: torch reads no read-only buffers
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(shape)
    if first or len(block_ids) < shape[2]:
        src = src[:, :, first : first + len(block_ids)]
    src = src.to(device)
    ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
    for layer, (k, v) in enumerate(zip(k_cache, v_cache, strict=True)):
        k.view(torch.uint8).index_copy_(0, ids, src[layer, 0])
        v.view(torch.uint8).index_copy_(0, ids, src[layer, 1])
