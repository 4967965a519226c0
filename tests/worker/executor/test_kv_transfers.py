"""The host tier end to end: a multi-turn workload whose prefixes outgrow the device
pool runs token-identical with and without the tier, and to transformers, while its
evicted prefixes come back from the host."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.checkpoints import VOCAB_SIZE
from tests.worker.executor.helpers import final_tokens, hf_greedy, run_all
from worker.executor import Executor, ExecutorConfig, KvCacheConfig, Request

BLOCK = 4
DEVICE_TOKENS = 96  # 24 blocks, for prompts whose distinct blocks add up to about 3 times that
HOST_BLOCKS = 64
# float32 K and V of the tiny Llama: 2 layers x 2 KV heads x 16 dims, both backends
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def conversations(rng: random.Random, count: int = 6, turns: int = 3) -> list[list[int]]:
    """Each turn's prompt: a shared system prompt, then every user message so far; the
    first turns of all conversations come first, then the second turns, and so on."""
    system = [rng.randrange(5, VOCAB_SIZE) for _ in range(16)]
    messages = [[[rng.randrange(5, VOCAB_SIZE) for _ in range(8)] for _ in range(turns)] for _ in range(count)]
    return [system + [tok for m in messages[c][: t + 1] for tok in m] for t in range(turns) for c in range(count)]


def config(backend: str, host_cache_size: int) -> ExecutorConfig:
    kv = KvCacheConfig(tokens_per_block=BLOCK, max_tokens=DEVICE_TOKENS, host_cache_size=host_cache_size)
    return ExecutorConfig(backend=backend, device="cpu" if backend == "torch" else None, dtype="float32",
                          max_batch_size=2, kv_cache_config=kv)  # fmt: skip


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_evicted_prefixes_reload_from_the_host_and_change_no_token(tiny_llama: Path, backend: str) -> None:
    if backend == "torch":
        pytest.importorskip("torch")
    prompts = conversations(random.Random(7))
    requests = [Request(input_token_ids=p, max_tokens=4, end_id=-1) for p in prompts]
    with Executor.from_model(tiny_llama, config(backend, 0)) as ex:
        without = [final_tokens(r) for r in run_all(ex, requests).values()]
    with Executor.from_model(tiny_llama, config(backend, HOST_BLOCKS * BLOCK * BYTES_PER_TOKEN)) as ex:
        with_tier = [final_tokens(r) for r in run_all(ex, requests).values()]
        stats = ex.get_latest_iteration_stats()[-1]
        blocks = ex.core.blocks
        blocks.check_invariants([])
        assert blocks.num_free == blocks.num_blocks  # every device block is back in the pool
        assert blocks.host is not None and blocks.host.num_blocks == HOST_BLOCKS
    assert with_tier == without
    assert with_tier == [hf_greedy(tiny_llama, p, 4) for p in prompts]
    assert stats.offloaded_blocks > 0 and stats.reused_host_blocks > 0, "nothing came back from the host"
    assert stats.max_num_host_blocks == HOST_BLOCKS and 0 < stats.cached_num_host_blocks <= HOST_BLOCKS


def test_a_host_tier_smaller_than_a_block_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="host_cache_size 100 bytes is less than one KV block"):
        Executor.from_model(tiny_llama, config("numpy", 100))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_on_cuda_the_host_tier_changes_no_token_in_either_kv_dtype(tiny_llama: Path, kv_dtype: str | None) -> None:
    """The side stream's copies, in the pool's dtype: the same tokens as without the tier."""
    prompts = conversations(random.Random(8), count=8, turns=4)
    requests = [Request(input_token_ids=p, max_tokens=6, end_id=-1) for p in prompts]
    itemsize = 1 if kv_dtype == "fp8" else 4

    def run(host_blocks: int) -> tuple[list[list[int]], int]:
        kv = KvCacheConfig(
            tokens_per_block=BLOCK,
            max_tokens=DEVICE_TOKENS,
            dtype=kv_dtype,
            host_cache_size=host_blocks * BLOCK * BYTES_PER_TOKEN * itemsize // 4,
        )
        config = ExecutorConfig(backend="torch", device="cuda", dtype="float32", max_batch_size=2, kv_cache_config=kv)
        with Executor.from_model(tiny_llama, config) as ex:
            tokens = [final_tokens(r) for r in run_all(ex, requests).values()]
            stats = ex.get_latest_iteration_stats()[-1]
            ex.core.blocks.check_invariants([])
            assert ex.core.blocks.num_free == ex.core.blocks.num_blocks
        return tokens, stats.reused_host_blocks

    without, _ = run(0)
    with_tier, host_hits = run(HOST_BLOCKS)
    assert with_tier == without
    assert host_hits > 0
