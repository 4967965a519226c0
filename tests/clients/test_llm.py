"""The in-process LLM API on a tiny checkpoint."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import pytest

from clients.llm import LLM, GenerationError, SamplingParams
from tests.checkpoints import make_checkpoint
from worker.executor import ExecutorConfig, FinishReason, KvCacheConfig


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    ckpt = make_checkpoint("llama_gqa", tmp_path_factory.mktemp("llm") / "llama")
    with LLM(ckpt, ExecutorConfig(backend="numpy", kv_cache_config=KvCacheConfig(max_tokens=4096))) as llm:
        yield llm


GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def test_generate_text_and_token_prompts_agree(llm: LLM) -> None:
    text = "The quick brown fox"
    prompts: list[str | list[int]] = [text, llm.encode(text)]
    by_text, by_ids = llm.generate(prompts, GREEDY)
    assert by_text.prompt == text and by_text.prompt_token_ids == by_ids.prompt_token_ids
    out = by_text.outputs[0]
    assert out.token_ids == by_ids.outputs[0].token_ids and len(out.token_ids) == 10
    assert out.text == llm.tokenizer.decode(out.token_ids) and out.finish_reason == FinishReason.LENGTH


def test_streaming_sync_and_async_builds_the_same_text(llm: LLM) -> None:
    final = llm.generate("Paged attention", GREEDY)[0]
    seen = [o.outputs[0].text for o in llm.generate_async("Paged attention", GREEDY, streaming=True)]
    assert len(seen) == 10 and seen[-1] == final.outputs[0].text

    async def collect() -> list[str]:
        return [o.outputs[0].text async for o in llm.generate_async("Paged attention", GREEDY, streaming=True)]

    assert asyncio.run(collect()) == seen
    # Every partial text extends the one before it.
    assert all(b.startswith(a) for a, b in itertools.pairwise(seen))


def test_future_style_result_and_aresult(llm: LLM) -> None:
    handle = llm.generate_async("tokenwire streams", GREEDY)
    expected = llm.generate("tokenwire streams", GREEDY)[0].outputs[0].token_ids
    assert handle.result(timeout=30).outputs[0].token_ids == expected

    async def get() -> list[int]:
        return (await llm.generate_async("tokenwire streams", GREEDY).aresult()).outputs[0].token_ids

    assert asyncio.run(get()) == handle.output.outputs[0].token_ids


def test_stop_string_truncates_the_text_and_ends_early(llm: LLM) -> None:
    full = llm.generate("Berlin is", SamplingParams(max_tokens=30, ignore_eos=True))[0].outputs[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    assert stop.strip(), f"pick a stop string from {full.text!r}"
    cut = llm.generate("Berlin is", SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.finish_reason == FinishReason.STOP_WORDS and len(cut.token_ids) < 30


def test_invalid_request_raises_a_clear_error(llm: LLM) -> None:
    with pytest.raises(GenerationError, match="max_tokens must be >= 1"):
        llm.generate("hello", SamplingParams(max_tokens=0))
    assert llm.generate("hello", GREEDY)[0].outputs[0].token_ids  # still serving


def test_chat_template_renders_messages(llm: LLM) -> None:
    text = llm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
