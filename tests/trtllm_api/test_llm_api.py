"""TensorRT-LLM's high-level API: its documents' snippets with tokenwire's imports
(`tensorrt_llm` / `tensorrt_llm.hlapi` -> `clients.llm`), on a tiny checkpoint."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from clients.llm import (
    LLM,
    CapacitySchedulerPolicy,
    KvCacheConfig,
    ModelConfig,
    QuantAlgo,
    RequestOutput,
    SamplingConfig,
    SamplingParams,
)
from clients.model_source import ModelNotFoundError
from tests.checkpoints import write_gguf

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def texts(outputs: list[RequestOutput]) -> list[tuple[str, list[int]]]:
    return [(o.text, o.token_ids) for o in outputs]


def test_basic_usage(model_dir: Path) -> None:
    config = ModelConfig(model_dir=model_dir)
    with LLM(config) as llm:
        prompts = ["To tell a story"]
        for output in llm.generate(prompts):
            assert output.text and output.token_ids and output.finished


def test_save_and_load_back_gives_identical_output(model_dir: Path, tmp_path: Path) -> None:
    config = ModelConfig(model_dir=model_dir)
    with LLM(config) as llm:
        want = texts(llm.generate(["To tell a story", "Paris is"], GREEDY))
        # dump the llm
        llm.save(tmp_path / "engine")
    # next time
    config = ModelConfig(model_dir=tmp_path / "engine")
    with LLM(config) as llm:
        assert texts(llm.generate(["To tell a story", "Paris is"], GREEDY)) == want


def test_save_writes_a_checkpoint_from_a_gguf_file(model_dir: Path, tmp_path: Path) -> None:
    gguf = write_gguf(model_dir, tmp_path / "model.gguf")
    with LLM(gguf) as llm:
        want = texts(llm.generate(["To tell a story"], GREEDY))
        saved = llm.save(tmp_path / "saved")
    assert (saved / "config.json").exists() and (saved / "model.safetensors").exists()
    with LLM(saved) as llm:
        assert texts(llm.generate(["To tell a story"], GREEDY)) == want


def test_quantization_tokenwire_does_not_do_is_refused_by_name(model_dir: Path) -> None:
    config = ModelConfig(model_dir=model_dir)
    config.quant_config.quant_algo = QuantAlgo.W4A16_AWQ
    with pytest.raises(NotImplementedError, match="W4A16_AWQ"):
        LLM(config)
    with pytest.raises(NotImplementedError, match="W8A16"):
        LLM(model_dir, quantization=QuantAlgo.W8A16)


def test_pipeline_stages_decode_as_one_process_and_more_than_the_layers_are_refused(model_dir: Path) -> None:
    # TensorRT-LLM's pp_size: the layers split into stages, one rank process each (gloo here).
    config = ModelConfig(model_dir=model_dir)
    with LLM(config) as llm:
        want = texts(llm.generate(["To tell a story", "Paris is"], GREEDY))
    config.parallel_config.pp_size = 2
    with LLM(config) as llm:
        assert texts(llm.generate(["To tell a story", "Paris is"], GREEDY)) == want
    config.parallel_config.pp_size = 4
    with pytest.raises(ValueError, match="2 layers do not split over 4 pipeline stages"):
        LLM(config)


def test_token_id_prompts(model_dir: Path) -> None:
    config = ModelConfig(model_dir=model_dir)
    with LLM(config) as llm:
        for output in llm.generate([[32, 12]], GREEDY):
            assert output.prompt_token_ids == [32, 12] and len(output.token_ids) == 8
        (single,) = llm.generate([32, 12], GREEDY)  # one prompt as ids
        assert single.token_ids == output.token_ids


def test_disabling_the_tokenizer_gives_ids_without_text(model_dir: Path) -> None:
    with LLM(ModelConfig(model_dir=model_dir), skip_tokenizer_init=True) as llm:
        (output,) = llm.generate([[32, 12]], GREEDY)
        assert output.text == "" and len(output.token_ids) == 8
        with pytest.raises(ValueError, match="token ids"):
            llm.generate("To tell a story")


def test_asyncio_based_generation(model_dir: Path) -> None:
    config = ModelConfig(model_dir=model_dir)
    with LLM(config, async_mode=True) as llm:

        async def main() -> list[str]:
            return [output.text async for output in llm.generate_async("To tell a story", GREEDY, streaming=True)]

        seen = asyncio.run(main())
        assert len(seen) == 8 and seen[-1] == llm.generate("To tell a story", GREEDY)[0].text


def test_future_style_generation(model_dir: Path) -> None:
    with LLM(ModelConfig(model_dir=model_dir)) as llm:
        # This will not block the main thread
        generation = llm.generate_async("To tell a story", GREEDY)
        output = generation.result()
        assert generation.result(timeout=10) is output

        async def main() -> RequestOutput:
            generation = llm.generate_async("To tell a story", GREEDY)
            return await generation.aresult()

        assert asyncio.run(main()).token_ids == output.token_ids


def test_customizing_sampling_with_sampling_config(model_dir: Path) -> None:
    config = ModelConfig(model_dir=model_dir, max_beam_width=4)
    with LLM(config) as llm:
        sampling_config = llm.get_default_sampling_config()
        # one option set: SamplingConfig is SamplingParams, settable field by field (mypy sees
        # SamplingParams' frozen fields, hence the ignores; the assignments work)
        assert isinstance(sampling_config, SamplingConfig) and isinstance(sampling_config, SamplingParams)
        sampling_config.beam_width = 4  # type: ignore[misc]
        sampling_config.max_new_tokens = 6
        sampling_config.ignore_eos = True  # type: ignore[misc]
        (output,) = llm.generate("To tell a story", sampling_config=sampling_config)
        (same,) = llm.generate("To tell a story", SamplingParams(beam_width=4, max_tokens=6, ignore_eos=True))
    assert output.token_ids == same.token_ids and len(output.token_ids) == 6
    with pytest.raises(AttributeError, match="no option 'beam_size'"):
        sampling_config.beam_size = 4
    with pytest.raises(TypeError, match="not both"):
        llm.generate("x", SamplingParams(), sampling_config=sampling_config)


def test_runtime_customization(model_dir: Path) -> None:
    config = ModelConfig(model_dir=model_dir)
    llm = LLM(config,
              kv_cache_config=KvCacheConfig(
                                max_new_tokens=128,
                                free_gpu_memory_fraction=0.8),
              capacity_scheduling_policy=CapacitySchedulerPolicy.GUARANTEED_NO_EVICT)
    try:
        cfg = llm.executor.config
        assert cfg.kv_cache_config.free_memory_fraction == 0.8
        assert cfg.scheduler_config.capacity_scheduler_policy is CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
        assert llm.get_default_sampling_config().max_new_tokens == 128
    finally:
        llm.shutdown()
    with LLM(model_dir, kv_cache_config=KvCacheConfig(max_tokens=256, enable_block_reuse=False),
             capacity_scheduling_policy=CapacitySchedulerPolicy.MAX_UTILIZATION) as llm:
        kv = llm.executor.core.blocks
        assert kv.num_blocks * kv.block_size == 256 and not kv.enable_reuse


class EncodeDecode:
    """A tokenizer with only encode and decode (no tokenizers.Tokenizer under it)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))


def test_tokenizer_customization(model_dir: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    with LLM(model_dir) as llm:
        want = texts(llm.generate(["To tell a story"], GREEDY))
    for my_faster_one in (Tokenizer.from_file(str(model_dir / "tokenizer.json")),
                          AutoTokenizer.from_pretrained(model_dir), EncodeDecode(model_dir)):
        config = ModelConfig(model_dir=model_dir)
        with LLM(config, tokenizer=my_faster_one) as llm:
            assert llm.tokenizer is my_faster_one
            assert texts(llm.generate(["To tell a story"], GREEDY)) == want, type(my_faster_one)


# -- Hugging Face hub ids, from a local cache laid out as huggingface_hub does --------------


def hub_cache(root: Path, repo_id: str, files_from: Path) -> None:
    repo = root / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(files_from, repo / "snapshots" / commit)


def test_hub_ids_resolve_from_the_local_cache(model_dir: Path, tmp_path: Path, monkeypatch: Any) -> None:
    pytest.importorskip("huggingface_hub")
    hub_cache(tmp_path, "acme/tiny-llama", model_dir)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with LLM(model_dir) as llm:
        want = texts(llm.generate(["To tell a story"], GREEDY))
    with LLM(ModelConfig(model_dir="acme/tiny-llama")) as llm:
        assert llm.model_path.parent.parent.name == "models--acme--tiny-llama"
        assert texts(llm.generate(["To tell a story"], GREEDY)) == want


def test_an_unknown_hub_id_offline_is_a_clear_error(tmp_path: Path, monkeypatch: Any) -> None:
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match=r"'Qwen/Qwen2.5-0.5B-Instruct' is not in the Hugging Face cache"):
        LLM("Qwen/Qwen2.5-0.5B-Instruct")
