"""Copies between the device KV pool and its host tier (block_manager.py decides
them): what one step needs before its forward, and handing them to the backend."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from worker.backends.base import Backend, HostKvBackend


@dataclass(frozen=True, slots=True)
class KvTransfers:
    """Offloads (device block -> host slot) then loads (host slot -> device block), in
    that order: a block a load writes may have been offloaded first, while a host slot
    an offload writes is never one a load of the same step reads."""

    offload_src: np.ndarray  # int64 [N] device blocks
    offload_dst: np.ndarray  # int64 [N] host slots
    load_src: np.ndarray  # int64 [M] host slots
    load_dst: np.ndarray  # int64 [M] device blocks


def issue(transfers: KvTransfers | None, backend: Backend) -> None:
    """Queue a step's copies on the backend, ahead of its forward."""
    if transfers is None:
        return
    assert isinstance(backend, HostKvBackend), "host-tier copies on a backend without a host tier"
    if transfers.offload_src.size:
        backend.offload_kv_blocks(transfers.offload_src, transfers.offload_dst)
    if transfers.load_src.size:
        backend.load_kv_blocks(transfers.load_src, transfers.load_dst)
