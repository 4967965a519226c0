"""A prompt's KV blocks out of one engine core and into another (worker/executor/kv_export.py):
the decode core continues token for token as one core doing both, reusing the imported
blocks instead of recomputing them; every block is back in its pool afterwards; the
blocks cross in one buffer, layer by layer, and a transfer partly cached already writes
only the rest; a layout or a size that differs is refused by name."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from worker.executor import EngineCore, ExecutorConfig, KvCacheConfig, Request, SamplingConfig, StepOutput
from worker.executor.kv_export import (
    KvBlocks,
    KvLayout,
    KvLayoutError,
    layout_of,
    prefix_blocks,
    read_blocks,
    store_of,
    write_blocks,
)

PROMPT = [11, 52, 7, 300, 41, 9, 18, 77, 5, 123, 64, 12, 3, 99]  # 3 full blocks of 4 and 2 tokens
SAMPLING = {"greedy": SamplingConfig(), "seeded": SamplingConfig(temperature=1.0, top_p=0.9, seed=8005)}


def config(block: int = 4, backend: str = "numpy") -> ExecutorConfig:
    return ExecutorConfig(
        backend=backend,
        deterministic=True,
        max_num_tokens=16,
        kv_cache_config=KvCacheConfig(tokens_per_block=block, max_tokens=256),
    )


def tokens_of(core: EngineCore, request: Request) -> list[int]:
    core.add_requests([(1, request)])
    outputs: list[StepOutput] = []
    while core.has_work:
        outputs.append(core.step())
    return [t for out in outputs for r in out.all_responses() if r.result is not None
            for t in r.result.output_token_ids[0]]  # fmt: skip


def layout(core: EngineCore, model: str) -> KvLayout:
    return layout_of(core.blocks, store_of(core.backend), model, tensor_parallel_size=1)


def export_prefix(core: EngineCore, model: str, token_ids: list[int]) -> KvBlocks:
    return read_blocks(core.blocks, store_of(core.backend), layout(core, model), token_ids)


def import_blocks(core: EngineCore, model: str, kv: KvBlocks) -> int:
    return write_blocks(core.blocks, store_of(core.backend), layout(core, model), kv)


@pytest.fixture
def cores(tiny_llama: Path) -> tuple[EngineCore, EngineCore]:
    return EngineCore.from_model(tiny_llama, config()), EngineCore.from_model(tiny_llama, config())


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_decode_core_continues_from_imported_blocks_as_one_core_would(
    tiny_llama: Path, cores: tuple[EngineCore, EngineCore], sampling: str
) -> None:
    whole = Request(PROMPT, 12, streaming=True, end_id=-1, sampling_config=SAMPLING[sampling])
    one_core = tokens_of(EngineCore.from_model(tiny_llama, config()), whole)

    prefill, decode = cores
    first = tokens_of(prefill, dataclasses.replace(whole, max_tokens=1))
    assert first == one_core[:1]
    kv = export_prefix(prefill, "tiny", PROMPT + first)
    assert kv.num_blocks == 3  # every full block of the prompt
    assert kv.token_ids == tuple(PROMPT[:12])
    assert len(kv.data) == 3 * kv.layout.bytes_per_block

    reused_before = decode.blocks.reused_blocks
    assert import_blocks(decode, "tiny", kv) == 3
    decode.blocks.check_invariants([])  # imported blocks wait in the prefix cache, held by no request
    assert decode.blocks.num_free == decode.blocks.num_blocks

    rest = tokens_of(decode, dataclasses.replace(whole, resumed_token_ids=first))
    assert first + rest == one_core
    assert decode.blocks.reused_blocks - reused_before == 3  # the prompt's blocks were not recomputed
    decode.blocks.check_invariants([])
    prefill.blocks.check_invariants([])


def test_blocks_already_cached_are_not_written_again(cores: tuple[EngineCore, EngineCore]) -> None:
    prefill, decode = cores
    first = tokens_of(prefill, Request(PROMPT[:9], 1, end_id=-1))
    kv = export_prefix(prefill, "tiny", PROMPT[:9] + first)
    import_blocks(decode, "tiny", kv)
    assert import_blocks(decode, "tiny", kv) == 0
    decode.blocks.check_invariants([])


def test_a_layout_that_differs_is_refused_naming_the_field(
    tiny_llama: Path, cores: tuple[EngineCore, EngineCore]
) -> None:
    prefill, decode = cores
    first = tokens_of(prefill, Request(PROMPT, 1, end_id=-1))
    kv = export_prefix(prefill, "tiny", PROMPT + first)
    with pytest.raises(KvLayoutError, match=r"model 'tiny' \(here 'other'\)"):
        import_blocks(decode, "other", kv)
    eights = EngineCore.from_model(tiny_llama, config(block=8))
    with pytest.raises(KvLayoutError, match=r"block_size 4 \(here 8\)"):
        import_blocks(eights, "tiny", kv)
    wider = dataclasses.replace(
        kv, layout=dataclasses.replace(layout(decode, "tiny"), dtype="bfloat16", tensor_parallel_size=2)
    )
    with pytest.raises(KvLayoutError, match=r"dtype 'bfloat16' \(here 'float32'\), tensor_parallel_size 2"):
        import_blocks(decode, "tiny", wider)
    assert decode.blocks.num_free == decode.blocks.num_blocks
    eights.blocks.check_invariants([])


@pytest.mark.parametrize("source", ["bytes", "a tensor"])
def test_the_torch_backends_cache_exports_and_imports_the_same_way(tiny_llama: Path, source: str) -> None:
    torch = pytest.importorskip("torch")
    whole = Request(PROMPT, 8, streaming=True, end_id=-1)
    one_core = tokens_of(EngineCore.from_model(tiny_llama, config(backend="torch")), whole)
    prefill, decode = (EngineCore.from_model(tiny_llama, config(backend="torch")) for _ in range(2))
    first = tokens_of(prefill, dataclasses.replace(whole, max_tokens=1))
    kv = export_prefix(prefill, "tiny", PROMPT + first)
    # A tensor is what a buffer shared by CUDA IPC opens as (worker/backends/torch_kv_ipc.py).
    data = kv.data if source == "bytes" else torch.frombuffer(bytearray(kv.data), dtype=torch.uint8)
    assert import_blocks(decode, "tiny", dataclasses.replace(kv, data=data)) == 3
    rest = tokens_of(decode, dataclasses.replace(whole, resumed_token_ids=first))
    assert first + rest == one_core
    assert export_prefix(decode, "tiny", PROMPT + first).data == kv.data  # the bytes written are the bytes read
    decode.blocks.check_invariants([])


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_the_blocks_travel_in_one_buffer_layer_by_layer(tiny_llama: Path, backend: str) -> None:
    if backend == "torch":
        torch = pytest.importorskip("torch")
    core = EngineCore.from_model(tiny_llama, config(backend=backend))
    first = tokens_of(core, Request(PROMPT, 1, end_id=-1))
    kv = export_prefix(core, "tiny", PROMPT + first)
    block_ids = prefix_blocks(core.blocks, PROMPT + first)
    store = store_of(core.backend)
    buffer = np.frombuffer(kv.data, dtype=np.uint8).reshape(len(store.k_cache), 2, len(block_ids), -1)
    for layer, (k, v) in enumerate(zip(store.k_cache, store.v_cache, strict=True)):
        for i, block in enumerate(block_ids):
            if backend == "torch":
                k_bytes, v_bytes = (c[block].contiguous().view(torch.uint8).numpy().tobytes() for c in (k, v))
            else:
                k_bytes, v_bytes = k[block].tobytes(), v[block].tobytes()
            assert buffer[layer, 0, i].tobytes() == k_bytes
            assert buffer[layer, 1, i].tobytes() == v_bytes


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_transfer_partly_cached_writes_only_the_rest_and_continues_the_same(tiny_llama: Path, backend: str) -> None:
    if backend == "torch":
        pytest.importorskip("torch")
    whole = Request(PROMPT, 8, streaming=True, end_id=-1)
    one_core = tokens_of(EngineCore.from_model(tiny_llama, config(backend=backend)), whole)
    prefill, decode = (EngineCore.from_model(tiny_llama, config(backend=backend)) for _ in range(2))
    first = tokens_of(prefill, dataclasses.replace(whole, max_tokens=1))
    kv = export_prefix(prefill, "tiny", PROMPT + first)
    two = dataclasses.replace(kv, token_ids=kv.token_ids[:8], data=export_prefix(prefill, "tiny", PROMPT[:9]).data)
    assert import_blocks(decode, "tiny", two) == 2
    assert import_blocks(decode, "tiny", kv) == 1  # the third block alone, from the middle of the buffer
    assert export_prefix(decode, "tiny", PROMPT + first).data == kv.data
    rest = tokens_of(decode, dataclasses.replace(whole, resumed_token_ids=first))
    assert first + rest == one_core
    decode.blocks.check_invariants([])


def test_blocks_of_another_size_are_refused(cores: tuple[EngineCore, EngineCore]) -> None:
    prefill, decode = cores
    first = tokens_of(prefill, Request(PROMPT, 1, end_id=-1))
    kv = export_prefix(prefill, "tiny", PROMPT + first)
    size = len(kv.data)
    with pytest.raises(KvLayoutError, match=f"3 blocks of this layout are {size} bytes; got {size - 4}"):
        import_blocks(decode, "tiny", dataclasses.replace(kv, data=kv.data[:-4]))
    assert decode.blocks.num_free == decode.blocks.num_blocks
