"""LLM(model, tensor_parallel_size=2) and LLM(model, pipeline_parallel_size=2): the model
split over two rank processes (gloo on the CPU) decodes what one process decodes, and
shutting the LLM down stops its ranks, so another parallel LLM can start in the same
process."""

from __future__ import annotations

from pathlib import Path

import pytest

from clients.llm import LLM, SamplingParams
from tests.checkpoints import make_checkpoint
from worker.executor import ExecutorConfig, KvCacheConfig
from worker.parallel.ranks import DistributedBackend

CONFIG = ExecutorConfig(backend="torch", device="cpu", kv_cache_config=KvCacheConfig(max_tokens=2048))
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
PROMPTS = ["The quick brown fox", "Paris is the capital of"]


def test_tensor_parallel_llm_decodes_as_one_process_and_stops_its_ranks(tmp_path: Path) -> None:
    ckpt = make_checkpoint("llama_gqa", tmp_path / "llama")
    with LLM(ckpt, CONFIG) as one:
        want = [out.outputs[0].token_ids for out in one.generate(PROMPTS, GREEDY)]
    for tp, pp in [(2, 1), (1, 2)]:  # the second starts after the first's ranks are gone
        with LLM(ckpt, CONFIG, tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
            backend = llm.executor.core.backend
            assert isinstance(backend, DistributedBackend)
            assert (backend.world.tensor_parallel_size, backend.world.pipeline_parallel_size) == (tp, pp)
            got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
        assert got == want
        assert not any(p.is_alive() for p in backend.processes)


def test_expert_parallel_llm_places_whole_experts_and_decodes_as_one_process(tmp_path: Path) -> None:
    """TensorRT-LLM's moe_expert_parallel_size equal to the tensor-parallel size: each rank
    holds half of the 4 experts, whole; any other size is refused before the model loads."""
    ckpt = make_checkpoint("mixtral_top2_window", tmp_path / "mixtral")
    with LLM(ckpt, CONFIG) as one:
        want = [out.outputs[0].token_ids for out in one.generate(PROMPTS, GREEDY)]
    with LLM(ckpt, CONFIG, tensor_parallel_size=2, moe_expert_parallel_size=2) as llm:
        backend = llm.executor.core.backend
        assert isinstance(backend, DistributedBackend) and backend.world.expert_parallel
        experts = backend.inner.model.layers[0].experts
        assert experts.gate_up.shape[0] == 2 and experts.first_expert == 0
        got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
    assert got == want
    with pytest.raises(ValueError, match="moe_expert_parallel_size 3: experts are placed over all 2"):
        LLM(ckpt, CONFIG, tensor_parallel_size=2, moe_expert_parallel_size=3)
