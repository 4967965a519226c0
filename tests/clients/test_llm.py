"""The in-process LLM API on a tiny checkpoint."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from clients.llm import LLM, FinishReason, GenerationError, SamplingParams
from tests.checkpoints import make_checkpoint
from worker.executor import ExecutorConfig, KvCacheConfig

CONFIG = ExecutorConfig(backend="numpy", kv_cache_config=KvCacheConfig(max_tokens=4096))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama_gqa", tmp_path_factory.mktemp("llm") / "llama")


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> Iterator[LLM]:
    with LLM(ckpt, CONFIG) as llm:
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


def test_streamed_text_never_shows_a_stop_string_it_later_cuts(llm: LLM) -> None:
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    full = llm.generate("Berlin is", params)[0].outputs[0]
    # A stop string across a token boundary: its first character comes with one
    # token, the rest with the next, so the first token's text must be held back.
    ends = [len(llm.tokenizer.decode(full.token_ids[:k])) for k in range(1, len(full.token_ids))]
    stops = [full.text[e - 1 : e + 1] for e in ends[3:] if 0 < e < len(full.text)]
    stop = next((s for s in stops if s.strip() and len(s) == 2 and "\ufffd" not in s), None)
    assert stop is not None, f"no stop string across tokens in {full.text!r}"
    cut = full.text[: full.text.find(stop)]
    seen = [o.outputs[0].text for o in llm.generate_async("Berlin is", params, streaming=True, stop=[stop])]
    assert all(b.startswith(a) for a, b in itertools.pairwise(seen)), seen  # nothing shown is taken back
    assert not any(stop in text for text in seen)
    deltas = [b[len(a) :] for a, b in itertools.pairwise(["", *seen])]
    assert "".join(deltas) == seen[-1] == cut


def test_several_sequences_stop_one_by_one(llm: LLM) -> None:
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=5, num_return_sequences=3)
    first, *others = llm.generate("Paged attention", params)[0].outputs
    # Text of the first sequence only, so the others run to max_tokens.
    pairs = (first.text[i : i + 2] for i in range(2, len(first.text) - 2))
    stop = next((s for s in pairs if s.isprintable() and s.strip() and not any(s in o.text for o in others)), None)
    assert stop is not None, f"no stop string in {first.text!r} alone"
    cut, *rest = llm.generate("Paged attention", params, stop=[stop])[0].outputs
    assert (cut.text, cut.finish_reason) == (first.text[: first.text.find(stop)], FinishReason.STOP_WORDS)
    assert [(o.text, o.finish_reason) for o in rest] == [(o.text, FinishReason.LENGTH) for o in others]


def test_logits_outputs(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True, return_context_logits=True, return_generation_logits=True)
    (whole,) = llm.generate("Paged attention", params)
    streamed = list(llm.generate_async("Paged attention", params, streaming=True))[-1]
    for out in (whole, streamed):
        logits = out.outputs[0].generation_logits
        assert out.context_logits is not None and logits is not None
        assert out.context_logits.shape == (len(out.prompt_token_ids or []), logits.shape[1])
        assert logits.shape[0] == 4
        assert list(np.argmax(logits, axis=1)) == out.outputs[0].token_ids  # greedy picks each row's best
    assert np.array_equal(whole.outputs[0].generation_logits, streamed.outputs[0].generation_logits)  # type: ignore[arg-type]


def test_shutdown_ends_the_requests_in_flight(ckpt: Path) -> None:
    llm = LLM(ckpt, CONFIG)
    handle = llm.generate_async("Paged attention", SamplingParams(max_tokens=400, ignore_eos=True), streaming=True)
    next(iter(handle))  # running
    start = time.monotonic()
    llm.shutdown()
    with pytest.raises(GenerationError, match="shut down"):
        handle.result(timeout=5)
    assert time.monotonic() - start < 5


def test_invalid_request_raises_a_clear_error(llm: LLM) -> None:
    with pytest.raises(GenerationError, match="max_tokens must be >= 1"):
        llm.generate("hello", SamplingParams(max_tokens=0))
    assert llm.generate("hello", GREEDY)[0].outputs[0].token_ids  # still serving


def test_chat_template_renders_messages(llm: LLM) -> None:
    text = llm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
