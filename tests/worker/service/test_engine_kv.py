"""The engine process's side of KV transfers (worker/service/engine_kv.py) on a KV cache
off CUDA: a hand-off asked to go by CUDA IPC goes as bytes and shares nothing, and a
CUDA IPC handle that cannot be opened here is answered `opened=False` (the sender then
sends frames) with nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.executor import EngineCore, ExecutorConfig, KvCacheConfig, Request
from worker.executor.kv_export import KvBlocks
from worker.executor.kv_shared import IpcBuffer
from worker.service.engine_kv import EngineKv, KvExported

PROMPT = [11, 52, 7, 300, 41, 9, 18, 77, 5, 123, 64, 12, 3, 99]  # 3 full blocks of 4 and 2 tokens


def core_of(model: Path) -> EngineCore:
    config = ExecutorConfig(backend="torch", device="cpu", deterministic=True, max_num_tokens=16,
                            kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=256))  # fmt: skip
    return EngineCore.from_model(model, config)


def hand_off(core: EngineCore, kv: EngineKv, how: str) -> KvExported:
    kv.watch(1, PROMPT, "tiny", "cuda_ipc" if how == "cuda_ipc" else "frames")
    core.add_requests([(1, Request(PROMPT, 1, end_id=-1))])
    exported: list[KvExported] = []
    while core.has_work:
        exported += kv.exports(core.step())
    assert len(exported) == 1
    return exported[0]


def test_a_hand_off_asked_to_go_by_cuda_ipc_goes_as_bytes_off_cuda(tiny_llama: Path) -> None:
    pytest.importorskip("torch")
    core = core_of(tiny_llama)
    kv = EngineKv(core)
    exported = hand_off(core, kv, "cuda_ipc")
    assert exported.ipc is None and exported.kv is not None
    assert exported.kv.num_blocks == 3 and len(exported.kv.data) == exported.kv.num_bytes
    assert kv.shared == 0


WHY = {
    "another host": ("elsewhere/0", 0.1, "is on host 'elsewhere/0'"),
    "a GPU not seen here": ("", 0.1, "GPU GPU-0 is not visible"),
    "too old to open": ("", 10.5, "the handle is 10.5 s old"),
}


@pytest.mark.parametrize("where", list(WHY))
def test_a_handle_that_cannot_be_opened_is_answered_so_and_nothing_is_written(tiny_llama: Path, where: str) -> None:
    pytest.importorskip("torch")
    from worker.backends.torch_kv_ipc import host_id

    prefill, decode = core_of(tiny_llama), core_of(tiny_llama)
    exported = hand_off(prefill, EngineKv(prefill), "frames")
    assert exported.kv is not None
    host, age_s, why = WHY[where]
    shared = IpcBuffer(host_id=host or host_id(), device_uuid="GPU-0",
                     handle=bytes(64), offset=0, size=exported.kv.num_bytes, ref_counter="/torch_1_1",
                     ref_counter_offset=0, event_handle=bytes(64), event_sync_required=False)  # fmt: skip
    kv = EngineKv(decode)
    done = kv.import_("t1", "tiny", KvBlocks(exported.kv.layout, exported.kv.token_ids, b""), shared, age_s)
    assert done.ipc and not done.opened and done.num_blocks == 0
    assert done.error is not None
    assert why in done.error
    assert decode.blocks.num_free == decode.blocks.num_blocks
    assert not list(decode.blocks.cached_prefix([*exported.kv.token_ids, 0]))  # nothing was cached
    written = kv.import_("t1", "tiny", exported.kv)  # the frames that follow the refusal
    assert written.error is None and written.num_blocks == 3 and not written.ipc
