"""The in-process LLM with LoRA adapters: registered at start or later (load_lora,
vLLM's LoRARequest), chosen per request by SamplingParams.lora, checked against peft."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.llm import LLM, GenerationError, LoRARequest, SamplingParams
from tests.worker.peft_adapters import make_adapter, peft_greedy
from worker.executor import ExecutorConfig, KvCacheConfig

pytest.importorskip("peft")

CONFIG = ExecutorConfig(backend="numpy", kv_cache_config=KvCacheConfig(max_tokens=4096))
PROMPT = [5, 6, 7, 8, 9, 10]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(service_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llm-lora")
    return {
        "a": make_adapter(service_model, root / "a", r=4, target_modules=["q_proj", "v_proj"], seed=11),
        "b": make_adapter(service_model, root / "b", r=8, target_modules=["o_proj", "up_proj", "down_proj"], seed=12),
    }


@pytest.fixture(scope="module")
def llm(service_model: Path, adapters: dict[str, Path]) -> Iterator[LLM]:
    with LLM(service_model, CONFIG, lora={"a": adapters["a"]}, max_loras=2, max_lora_rank=8) as model:
        yield model


def test_a_request_runs_under_the_adapter_it_names(llm: LLM, service_model: Path, adapters: dict[str, Path]):
    under_a = llm.generate(PROMPT, GREEDY, lora="a")[0].token_ids
    assert under_a == peft_greedy(service_model, adapters["a"], PROMPT, 8)[0]
    assert llm.generate(PROMPT, GREEDY)[0].token_ids == peft_greedy(service_model, None, PROMPT, 8)[0]
    assert under_a != llm.generate(PROMPT, GREEDY)[0].token_ids


def test_adapters_load_by_request_and_unload(llm: LLM, service_model: Path, adapters: dict[str, Path]):
    request = LoRARequest("b", 2, adapters["b"])
    out = llm.generate([PROMPT, PROMPT[:3]], GREEDY, lora_request=request)
    assert llm.lora_names() == ["a", "b"]
    assert out[0].token_ids == peft_greedy(service_model, adapters["b"], PROMPT, 8)[0]
    llm.unload_lora("b")
    assert llm.lora_names() == ["a"]
    with pytest.raises(GenerationError, match="unknown LoRA adapter 'b'"):
        llm.generate(PROMPT, GREEDY, lora="b")
    assert len(llm.generate(PROMPT, GREEDY, lora="a")[0].token_ids) == 8  # the others serve on


def test_a_rank_above_the_bound_is_refused(llm: LLM, service_model: Path, tmp_path: Path):
    wide = make_adapter(service_model, tmp_path / "wide", r=16, target_modules=["q_proj"], seed=13)
    with pytest.raises(ValueError, match="rank 16 is above max_rank 8"):
        llm.load_lora("wide", wide)
    assert "wide" not in llm.lora_names()


def test_without_lora_options_adapters_cannot_load(service_model: Path, adapters: dict[str, Path]):
    with LLM(service_model, CONFIG) as plain, pytest.raises(ValueError, match="LoRA is off"):
        plain.load_lora("a", adapters["a"])
    with LLM(service_model, CONFIG, enable_lora=True) as enabled:
        enabled.load_lora("a", adapters["a"])
        assert enabled.lora_names() == ["a"]
