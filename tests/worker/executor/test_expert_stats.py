"""Router statistics in the iteration stats: an MoE model's records carry the tokens each
expert of each layer took, which add up to every token the layer computed times the
experts each token picks; a dense model's carry none."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.checkpoints import make_checkpoint
from tests.worker.executor.helpers import run_all
from worker.executor import Executor, ExecutorConfig, KvCacheConfig, Request

TOP_K = 4  # qwen3_moe_top4_dense_layer: 8 experts; layers 0 and 2 MoE, layer 1 dense


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen3_moe_top4_dense_layer", tmp_path_factory.mktemp("moe") / "ckpt")


def _config(backend: str) -> ExecutorConfig:
    kv = KvCacheConfig(tokens_per_block=4, max_tokens=1024)
    # A chunk budget smaller than the prompts: some steps sample nothing and carry their counts over.
    return ExecutorConfig(backend=backend, device="cpu" if backend == "torch" else None, kv_cache_config=kv,
                          max_num_tokens=16, overlap_scheduling=backend == "torch", iteration_stats_max=10_000)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_expert_tokens_add_up_to_the_routed_tokens(moe_checkpoint: Path, backend: str) -> None:
    prompts = [list(range(10, 40)), [5, 6, 7], list(range(100, 121))]
    with Executor.from_model(moe_checkpoint, _config(backend)) as ex:
        run_all(ex, [Request(input_token_ids=p, max_tokens=5, end_id=-1) for p in prompts])
        stats = ex.get_latest_iteration_stats()
    counts = np.sum([s.expert_tokens for s in stats if s.expert_tokens is not None], axis=0)
    tokens = sum(s.num_scheduled_tokens for s in stats)
    assert counts.shape == (3, 8)
    assert counts[0].sum() == tokens * TOP_K  # every token of the first layer
    assert not counts[1].any()  # the dense layer routes nothing
    # The last layer runs its MLP on the sampled rows only: one per sequence per generated token.
    assert counts[2].sum() == len(prompts) * 5 * TOP_K
    assert (counts[0] > 0).sum() > 1  # the router spreads the tokens


def test_dense_model_reports_no_expert_tokens(tiny_llama: Path) -> None:
    with Executor.from_model(tiny_llama, _config("numpy")) as ex:
        run_all(ex, [Request(input_token_ids=[5, 6, 7], max_tokens=3, end_id=-1)])
        stats = ex.get_latest_iteration_stats()
    assert stats and all(s.expert_tokens is None for s in stats)
