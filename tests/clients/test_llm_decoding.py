"""The LLM API's decoding settings reach the executor: beam search, penalties,
top-N log probs, guided decoding."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.llm import LLM, FinishReason, SamplingParams
from tests.checkpoints import make_checkpoint
from worker.executor import Executor, ExecutorConfig, KvCacheConfig, Request, SamplingConfig

CONFIG = ExecutorConfig(backend="numpy", max_beam_width=4, kv_cache_config=KvCacheConfig(max_tokens=4096))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama_gqa", tmp_path_factory.mktemp("llm") / "llama")


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> Iterator[LLM]:
    with LLM(ckpt, CONFIG) as llm:
        yield llm


def test_beam_search_returns_the_executors_best_beams(llm: LLM, ckpt: Path) -> None:
    prompt = llm.encode("The quick brown fox")
    params = SamplingParams(max_tokens=8, ignore_eos=True, beam_width=4, num_return_sequences=2, length_penalty=1.0,
                            return_log_probs=True)
    (out,) = llm.generate([prompt], params)
    with Executor.from_model(ckpt, CONFIG) as ex:
        rid = ex.enqueue_request(Request(input_token_ids=prompt, max_tokens=8, end_id=-1, num_return_sequences=2,
                                         sampling_config=SamplingConfig(beam_width=4, length_penalty=1.0)))
        (direct,) = ex.await_responses(rid, timeout=60)
    assert direct.result is not None
    assert [o.token_ids for o in out.outputs] == direct.result.output_token_ids
    assert [o.finish_reason for o in out.outputs] == [FinishReason.LENGTH] * 2
    assert out.outputs[0].cum_log_prob is not None and out.outputs[0].cum_log_prob >= out.outputs[1].cum_log_prob  # type: ignore[operator]
    streamed = list(llm.generate_async(prompt, params, streaming=True))
    assert [o.token_ids for o in streamed[-1].outputs] == direct.result.output_token_ids


def test_penalties_log_probs_and_guided_regex(llm: LLM) -> None:
    prompt = "Paged attention"
    free, penalised = llm.generate([prompt, prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0], llm.generate(
        prompt, SamplingParams(max_tokens=16, ignore_eos=True, presence_penalty=100.0, top_n_log_probs=2))[0]
    tokens = penalised.outputs[0].token_ids
    assert len(set(tokens)) == len(tokens) and tokens != free.outputs[0].token_ids
    top_ids, top = penalised.outputs[0].top_token_ids, penalised.outputs[0].top_log_probs
    assert top is not None and len(top) == 16 and all(len(t) == 2 and t[0] >= t[1] for t in top)
    assert top_ids is not None and [len(t) for t in top_ids] == [2] * 16
    (guided,) = llm.generate(prompt, SamplingParams(max_tokens=30, guided_regex="(ab|cd)+!", temperature=1.0, seed=3))
    text, reason = guided.outputs[0].text, guided.outputs[0].finish_reason
    assert re.fullmatch(r"(ab|cd)+!", text) or (reason == FinishReason.LENGTH and re.fullmatch(r"(ab|cd)+", text))
    with pytest.raises(ValueError, match="at most one of"):
        llm.generate(prompt, SamplingParams(guided_json=True, guided_regex="a"))
