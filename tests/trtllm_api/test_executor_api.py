"""TensorRT-LLM's Executor API under tokenwire's names: the classes and calls its
documents use, in their order, plus the edge cases where tokenwire once differed
from them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from worker.executor import (
    EngineCore,
    Executor,
    ExecutorConfig,
    FinishReason,
    GuidedDecodingConfig,
    GuidedDecodingParams,
    KvCacheConfig,
    OutputConfig,
    PackedWordList,
    Request,
    RequestState,
    Response,
    SamplingConfig,
)
from worker.executor.validation import normalize_word_list

PROMPT = list(range(20, 40))


def config(**kw: Any) -> ExecutorConfig:
    return ExecutorConfig(backend="numpy", max_beam_width=4,
                          kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=4096), **kw)


def until_final(executor: Executor, request_id: int) -> list[Response]:
    responses: list[Response] = []
    while not responses or not (responses[-1].has_error or responses[-1].result.is_final):  # type: ignore[union-attr]
        got = executor.await_responses(request_id, timeout=60)
        assert got, "no response within 60 s"
        responses += got
    return responses


def tokens_of(responses: list[Response]) -> list[int]:
    return [t for r in responses for t in r.result.output_token_ids[0]]  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def executor(model_dir: Path) -> Any:
    with Executor.from_model(model_dir, config()) as ex:
        yield ex


def test_the_executor_class(executor: Executor) -> None:
    # enqueueRequest / enqueueRequests, awaitResponses by id or for any id, cancelRequest, stats
    assert executor.can_enqueue_requests()
    request = Request(input_token_ids=PROMPT, max_tokens=5, streaming=True, sampling_config=SamplingConfig(),
                      output_config=OutputConfig())
    request_id = executor.enqueue_request(request)
    responses = until_final(executor, request_id)
    for response in responses:
        assert not response.has_error  # check the error before taking the result
        result = response.result
        assert result is not None and result.is_final == (response is responses[-1])
    assert len(tokens_of(responses)) == 5
    # streaming = false: one response, final, every token in output_token_ids
    (single,) = until_final(executor, executor.enqueue_request(Request(input_token_ids=PROMPT, max_tokens=5)))
    assert single.result is not None and single.result.output_token_ids[0] == tokens_of(responses)
    ids = executor.enqueue_requests([Request(input_token_ids=PROMPT, max_tokens=200, end_id=-1)] * 2)
    executor.cancel_request(ids[0])
    assert until_final(executor, ids[0])[-1].result.finish_reasons == [FinishReason.CANCELLED]  # type: ignore[union-attr]
    executor.cancel_request(ids[1])
    until_final(executor, ids[1])
    assert executor.get_latest_iteration_stats()
    bad = executor.enqueue_request(Request(input_token_ids=[], max_tokens=1))
    (error,) = executor.await_responses(bad, timeout=60)
    assert error.has_error and error.result is None and "empty" in (error.error_msg or "")


def test_can_enqueue_requests_is_false_once_shut_down(model_dir: Path) -> None:
    ex = Executor.from_model(model_dir, config())
    assert ex.can_enqueue_requests()
    ex.shutdown()
    assert not ex.can_enqueue_requests()


def test_num_return_sequences_results_carry_sequence_index_and_finals(executor: Executor) -> None:
    request = Request(input_token_ids=PROMPT, max_tokens=4, streaming=True, num_return_sequences=3, end_id=-1,
                      sampling_config=SamplingConfig(temperature=1.0, seed=3))
    responses = until_final(executor, executor.enqueue_request(request))
    results = [r.result for r in responses]
    assert {r.sequence_index for r in results} == {0, 1, 2}  # type: ignore[union-attr]
    assert sum(r.is_sequence_final for r in results) == 3  # type: ignore[union-attr]
    assert [r.is_final for r in results].count(True) == 1 and results[-1].is_final  # type: ignore[union-attr]


def test_requests_with_different_beam_widths(executor: Executor) -> None:
    ids = executor.enqueue_requests([Request(input_token_ids=PROMPT, max_tokens=4, end_id=-1,
                                             sampling_config=SamplingConfig(beam_width=w)) for w in (1, 2, 4)])
    for request_id in ids:
        (final,) = until_final(executor, request_id)
        assert final.result is not None and len(final.result.output_token_ids) == 1  # num_return_sequences = 1
        assert len(final.result.output_token_ids[0]) == 4


def test_logits_post_processor_under_beam_search_sees_all_beams_at_once(model_dir: Path) -> None:
    calls: list[tuple[int, tuple[int, ...], int, int | None]] = []

    def processor(request_id: int, logits: np.ndarray, tokens: list[list[int]], client_id: int | None) -> None:
        calls.append((request_id, logits.shape, len(tokens), client_id))
        logits[:, 7] = -np.inf  # a ban every beam obeys

    with Executor.from_model(model_dir, config(logits_post_processor_map={"ban7": processor})) as ex:
        request = Request(input_token_ids=PROMPT, max_tokens=5, end_id=-1, client_id=42, num_return_sequences=3,
                          sampling_config=SamplingConfig(beam_width=3), logits_post_processor_name="ban7")
        (final,) = until_final(ex, ex.enqueue_request(request))
    assert final.result is not None and all(7 not in beam for beam in final.result.output_token_ids)
    # the first step has the one beam the prompt made; every later step all 3, in one call
    assert [(shape, n) for _, shape, n, _ in calls] == [((1, 320), 1)] + [((3, 320), 3)] * 4
    assert {(rid, cid) for rid, _, _, cid in calls} == {(calls[0][0], 42)}


def test_guided_decoding_config_from_a_hugging_face_tokenizer(model_dir: Path) -> None:
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # TensorRT-LLM's vocabulary extraction, as its documents write it
    encoded_vocab = tokenizer.get_vocab()
    encoded_vocab = [token for token, _ in sorted(encoded_vocab.items(), key=lambda x: x[1])]
    tokenizer_str = tokenizer.backend_tokenizer.to_str()
    stop_token_ids = [tokenizer.eos_token_id]
    guided = GuidedDecodingConfig(encoded_vocab, tokenizer_str, stop_token_ids)

    request = Request(input_token_ids=PROMPT, max_tokens=30, guided_decoding_params=GuidedDecodingParams(
        "regex", "(ab|cd)+!"), sampling_config=SamplingConfig(temperature=1.0, seed=2))
    outputs = []
    for cfg in (config(guided_decoding_config=guided), config()):
        with Executor.from_model(model_dir, cfg) as ex:
            (final,) = until_final(ex, ex.enqueue_request(request))
            assert final.result is not None
            outputs.append(final.result.output_token_ids[0])
            text = ex.tokenizer.decode(outputs[-1][:-1] if outputs[-1][-1] == 2 else outputs[-1])
            assert re.fullmatch(r"(ab|cd)+!", text), text
    assert outputs[0] == outputs[1]  # the model's own tokenizer, given explicitly: the same guide


# -- request stats -------------------------------------------------------------------------


def test_request_stats_for_live_requests_each_iteration_and_finished_at_the_end(model_dir: Path) -> None:
    with Executor.from_model(model_dir, config(request_stats_max_iterations=100)) as ex:
        request_id = ex.enqueue_request(Request(input_token_ids=PROMPT, max_tokens=6, end_id=-1))
        until_final(ex, request_id)
        stats = [s for s in ex.get_latest_request_stats() if s.request_id == request_id]
    live = [s for s in stats if s.state is not RequestState.FINISHED]
    assert len(live) >= 5 and {s.state for s in live} <= {RequestState.CONTEXT, RequestState.GENERATION}
    assert [s.num_generated_tokens for s in live] == sorted(s.num_generated_tokens for s in live)
    assert stats[-1].state is RequestState.FINISHED and stats[-1].num_generated_tokens == 6


def test_the_final_request_stats_record_says_finished(executor: Executor) -> None:
    executor.get_latest_request_stats()
    until_final(executor, executor.enqueue_request(Request(input_token_ids=PROMPT, max_tokens=3)))
    (record,) = executor.get_latest_request_stats()  # without request_stats_max_iterations: one, at the end
    assert record.state is RequestState.FINISHED


# -- the bugs --------------------------------------------------------------------------------


def test_plain_two_word_lists_are_words_and_the_packed_form_is_explicit(executor: Executor) -> None:
    # [[5, 7], [1, 2]] once read as the [2, len] form (words [5] and [7])
    assert normalize_word_list([[5, 7], [1, 2]], "stop_words") == [[5, 7], [1, 2]]
    assert normalize_word_list(PackedWordList([5, 7, 3, 9, 2], [0, 3, 5, -1, -1]), "stop_words") == [[5, 7, 3],
                                                                                                    [9, 2]]
    assert normalize_word_list(PackedWordList([5, 7, 3, 9, 2], [3, 5, -1, -1, -1]), "stop_words") == [[5, 7, 3],
                                                                                                    [9, 2]]
    (free,) = until_final(executor, executor.enqueue_request(Request(input_token_ids=PROMPT, max_tokens=8, end_id=-1)))
    tokens = tokens_of([free])
    word = tokens[2:4]
    (stopped,) = until_final(executor, executor.enqueue_request(
        Request(input_token_ids=PROMPT, max_tokens=8, end_id=-1, stop_words=[word, [1, 2]])))
    first = next(i for i in range(len(tokens) - 1) if tokens[i : i + 2] == word)
    assert tokens_of([stopped]) == tokens[: first + 2]
    assert stopped.result.finish_reasons == [FinishReason.STOP_WORDS]  # type: ignore[union-attr]


def test_a_request_that_ends_in_its_first_step_leaves_its_prompt_for_reuse(model_dir: Path) -> None:
    core = EngineCore.from_model(model_dir, config())
    prompt = list(range(50, 70))  # 5 full blocks of 4
    for request_id in (1, 2):
        core.add_requests([(request_id, Request(input_token_ids=prompt, max_tokens=1))])
        stats = []
        while core.has_work:
            stats += core.step().request_stats
    (second,) = [s for s in stats if s.request_id == 2]
    assert second.reused_blocks == 4  # every full block but the one holding the last prompt token


def test_top_k_zero_with_top_p_zero_is_greedy_and_the_default_seed_is_zero(executor: Executor) -> None:
    def run(sampling: SamplingConfig) -> list[int]:
        (final,) = until_final(executor, executor.enqueue_request(
            Request(input_token_ids=PROMPT, max_tokens=8, end_id=-1, sampling_config=sampling)))
        return tokens_of([final])

    greedy = run(SamplingConfig())
    assert run(SamplingConfig(top_k=0, top_p=0.0, temperature=1.0)) == greedy
    sampled = run(SamplingConfig(temperature=1.0))
    assert sampled != greedy  # (shows the test samples at all)
    assert run(SamplingConfig(temperature=1.0)) == sampled == run(SamplingConfig(temperature=1.0, seed=0))


def test_normalize_log_probs_renormalizes_over_the_tokens_sampling_keeps(model_dir: Path) -> None:
    def run(normalize: bool, sampling: SamplingConfig) -> Any:
        with Executor.from_model(model_dir, config(normalize_log_probs=normalize)) as ex:
            (final,) = until_final(ex, ex.enqueue_request(Request(
                input_token_ids=PROMPT, max_tokens=6, end_id=-1, sampling_config=sampling,
                output_config=OutputConfig(return_log_probs=True, top_n_log_probs=5))))
        return final.result

    top5 = SamplingConfig(temperature=1.0, top_k=5, seed=1)
    full, normalized = run(False, top5), run(True, top5)
    assert normalized.output_token_ids == full.output_token_ids  # the same draws: only the log probs differ
    want = [lp - np.logaddexp.reduce(np.array(top, dtype=np.float64))
            for lp, top in zip(full.log_probs[0], full.top_log_probs[0], strict=True)]
    assert normalized.log_probs[0] == pytest.approx(want, abs=1e-5)
    assert normalized.cum_log_probs[0] == pytest.approx(sum(want), abs=1e-4)
    assert all(lp < 0 for lp in full.log_probs[0])
    assert run(True, SamplingConfig()).log_probs[0] == [0.0] * 6  # greedy keeps one token
