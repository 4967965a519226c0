"""KV blocks between two engine cores on CUDA (worker/executor/kv_export.py): the bf16
and FP8 caches' bytes read back as written, and the decode core continues the greedy
run of one core doing both."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.checkpoints import make_checkpoint
from worker.executor import EngineCore, ExecutorConfig, KvCacheConfig, Request
from worker.executor.kv_export import KvLayout, layout_of, read_blocks, store_of, write_blocks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PROMPT = [11, 52, 7, 300, 41, 9, 18, 77, 5, 123, 64, 12, 3, 99, 250, 31, 8, 14]  # 4 full blocks of 4 and 2 tokens


def tokens_of(core: EngineCore, request: Request) -> list[int]:
    core.add_requests([(1, request)])
    tokens: list[int] = []
    while core.has_work:
        for r in core.step().all_responses():
            assert r.result is not None, r.error_msg
            tokens += r.result.output_token_ids[0]
    return tokens


@pytest.mark.parametrize("kv_dtype", [None, "fp8"], ids=["bf16", "fp8"])
def test_cuda_caches_move_between_cores(tmp_path: Path, kv_dtype: str | None) -> None:
    model = make_checkpoint("llama_gqa", tmp_path / "llama")
    kv_config = KvCacheConfig(tokens_per_block=4, max_tokens=256, dtype=kv_dtype)
    config = ExecutorConfig(backend="torch", device="cuda", deterministic=True, max_num_tokens=16,
                            kv_cache_config=kv_config)  # fmt: skip
    whole = Request(PROMPT, 8, streaming=True, end_id=-1)
    one_core = tokens_of(EngineCore.from_model(model, config), whole)
    prefill, decode = EngineCore.from_model(model, config), EngineCore.from_model(model, config)
    first = tokens_of(prefill, dataclasses.replace(whole, max_tokens=1))

    def layout(core: EngineCore) -> KvLayout:
        return layout_of(core.blocks, store_of(core.backend), "tiny", 1)

    kv = read_blocks(prefill.blocks, store_of(prefill.backend), layout(prefill), PROMPT + first)
    assert kv.layout.dtype == ("float8_e4m3fn" if kv_dtype == "fp8" else "bfloat16")
    assert kv.num_blocks == 4
    assert write_blocks(decode.blocks, store_of(decode.backend), layout(decode), kv) == 4
    again = read_blocks(decode.blocks, store_of(decode.backend), layout(decode), PROMPT + first)
    assert again.data == kv.data
    rest = tokens_of(decode, dataclasses.replace(whole, resumed_token_ids=first))
    assert first + rest == one_core
    decode.blocks.check_invariants([])
