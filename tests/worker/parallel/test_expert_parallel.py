"""Expert parallelism over 2 ranks (gloo, on the CPU): each rank holds and reads only its
whole experts, greedy tokens equal one rank's and transformers' with prompts prefilled in
chunks, logits within 1e-4 of one rank's (float32: the all-reduce sums two partial sums in
another order), the router statistics equal one rank's, and an expert count that does not
split over the ranks is refused before any rank starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.checkpoints import make_checkpoint
from tests.worker.executor.helpers import final_tokens, hf_greedy, run_all
from tests.worker.parallel.executors import parallel_executor as executor
from worker.backends.torch_backend import TorchBackend
from worker.executor import Executor, ExecutorConfig, OutputConfig, ParallelConfig, Request, SamplingConfig
from worker.models.loader import load_model
from worker.parallel.group import TensorGroup, World

FAMILIES = ["mixtral_top2_window", "qwen3_moe_top4_dense_layer", "gpt_oss_sinks"]  # 4, 8 and 4 experts
PROMPTS = [list(range(7, 30)), [5, 9, 200, 31], list(range(100, 140, 3))]
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=FAMILIES)
def moe_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(request.param, tmp_path_factory.mktemp("moe") / request.param)


@pytest.fixture(scope="module")
def runs(moe_model: Path) -> dict[str, dict[str, Any]]:
    """One run on one rank and one under expert parallelism over 2: tokens, the first
    request's generation logits and the summed router statistics. 16 tokens a step: the
    longer prompts go in chunks beside the others' generation."""

    def run(size: int) -> dict[str, Any]:
        reqs = [Request(input_token_ids=p, max_tokens=NEW_TOKENS, end_id=-1,
                        sampling_config=SamplingConfig(temperature=0.0),
                        output_config=OutputConfig(return_generation_logits=i == 0))
                for i, p in enumerate(PROMPTS)]  # fmt: skip
        with executor(moe_model, size, expert_parallel=size > 1, max_num_tokens=16,
                      iteration_stats_max=10_000) as ex:  # fmt: skip
            got = list(run_all(ex, reqs).values())
            stats = ex.get_latest_iteration_stats()
        return {
            "tokens": [final_tokens(r) for r in got],
            "logits": np.asarray(got[0][-1].result.generation_logits),  # type: ignore[union-attr]
            "expert_tokens": np.sum([s.expert_tokens for s in stats if s.expert_tokens is not None], axis=0),
        }

    return {"one": run(1), "expert_parallel": run(2)}


def test_greedy_equals_one_rank_and_transformers(runs: dict[str, dict[str, Any]], moe_model: Path) -> None:
    ep, one = runs["expert_parallel"], runs["one"]
    assert ep["tokens"] == one["tokens"]
    np.testing.assert_allclose(ep["logits"], one["logits"], atol=1e-4, rtol=0)
    assert ep["tokens"] == [hf_greedy(moe_model, p, NEW_TOKENS) for p in PROMPTS]


def test_router_statistics_equal_one_ranks(runs: dict[str, dict[str, Any]]) -> None:
    """Every rank routes every token: rank 0's counts are the model's, not its experts' share."""
    ep, one = runs["expert_parallel"], runs["one"]
    assert ep["expert_tokens"].shape == one["expert_tokens"].shape
    np.testing.assert_array_equal(ep["expert_tokens"], one["expert_tokens"])
    assert ep["expert_tokens"].sum() > 0


class _ReadLog(dict[str, Any]):
    """The checkpoint's tensors, noting which ones the backend reads."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        super().__init__(tensors)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> Any:
        self.read.add(name)
        return super().__getitem__(name)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_and_reads_only_its_experts(moe_model: Path, rank: int) -> None:
    """Rank r of 2 stacks experts r * E / 2 .. (r + 1) * E / 2 - 1, whole, and never reads
    another rank's expert tensors (building a rank's weights runs no collective)."""
    model = load_model(moe_model)
    config = model.config
    if config.moe_checkpoint == "gpt_oss":
        pytest.skip("gpt-oss stores every expert of a layer in one tensor: a rank reads it whole")
    tensors = _ReadLog(dict(model.weights))
    cpu = torch.device("cpu")
    world = World(rank, 2, 1, cpu, TensorGroup(rank, 2, cpu), expert_parallel=True)
    backend = TorchBackend(config, cpu, "float32", weights=tensors, world=world, use_cuda_graphs=False)
    per_rank = config.num_experts // 2
    held = range(rank * per_rank, (rank + 1) * per_rank)
    block, (gate, up, down) = (("block_sparse_moe", ("w1", "w3", "w2")) if config.moe_checkpoint == "mixtral"
                               else ("mlp", ("gate_proj", "up_proj", "down_proj")))  # fmt: skip
    moe_layers = [(i, layer.experts) for i, layer in enumerate(backend.model.layers) if layer.experts is not None]
    assert [i for i, _ in moe_layers] == list(config.moe_layers)
    for i, experts in moe_layers:
        assert experts.first_expert == held.start
        assert experts.gate_up.shape == (per_rank, 2 * config.moe_intermediate_size, config.hidden_size)
        for local, e in enumerate(held):
            p = f"model.layers.{i}.{block}.experts.{e}."
            want_gate_up = np.concatenate([model.weights[p + f"{gate}.weight"], model.weights[p + f"{up}.weight"]])
            np.testing.assert_array_equal(experts.gate_up[local].numpy(), want_gate_up)
            np.testing.assert_array_equal(experts.down[local].numpy(), model.weights[p + f"{down}.weight"])
        # The router is whole: every rank routes every token.
        assert experts.router.shape == (config.num_experts, config.hidden_size)
    read_experts = {int(name.split(".experts.")[1].split(".")[0]) for name in tensors.read if ".experts." in name}
    assert read_experts == set(held)


@pytest.mark.parametrize(
    ("name", "tp", "message"),
    [
        ("qwen3_moe_top1_sparse_step", 4, "6 experts do not split evenly over 4 tensor-parallel ranks"),
        ("llama_gqa", 2, "needs a mixture-of-experts model"),
    ],
)
def test_a_model_whose_experts_do_not_split_is_refused(name: str, tp: int, message: str,
                                                       tmp_path: Path) -> None:  # fmt: skip
    model = make_checkpoint(name, tmp_path / name)
    config = ExecutorConfig(backend="torch", device="cpu", dtype="float32",
                            parallel_config=ParallelConfig(tp, expert_parallel=True))  # fmt: skip
    with pytest.raises(ValueError, match=message):
        Executor.from_model(model, config)
