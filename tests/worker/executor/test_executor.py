"""The Executor end to end on tiny random checkpoints and the numpy backend."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from tests.checkpoints import CHECKPOINTS, VOCAB_SIZE
from tests.worker.executor.helpers import final_tokens, hf_greedy, run_all
from worker.executor import (
    CapacitySchedulerPolicy,
    Executor,
    ExecutorConfig,
    FinishReason,
    KvCacheConfig,
    OutputConfig,
    PackedWordList,
    Request,
    SamplingConfig,
    SchedulerConfig,
)


def config(**kw: object) -> ExecutorConfig:
    kv = kw.pop("kv", KvCacheConfig(tokens_per_block=4, max_tokens=4096))
    return ExecutorConfig(backend="numpy", kv_cache_config=kv, **kw)  # type: ignore[arg-type]


# Both loops: the plain one, and the overlapped one a CUDA backend gets, in which
# step N+1 is scheduled before step N's tokens are known.
OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, VOCAB_SIZE) for _ in range(n)]


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
@OVERLAP
def test_greedy_matches_transformers_alone_and_batched_with_chunked_context(
    tiny_checkpoints: dict[str, Path], name: str, overlap: bool
) -> None:
    ckpt = tiny_checkpoints[name]
    rng = random.Random(1)
    prompts = [prompt(rng, rng.randrange(1, 40)) for _ in range(16)]
    expected = [hf_greedy(ckpt, p, 12) for p in prompts]
    # max_num_tokens 24 splits the long prompts into chunks that share
    # iterations with other requests' generation steps.
    with Executor.from_model(ckpt, config(max_num_tokens=24, overlap_scheduling=overlap)) as ex:
        alone = run_all(ex, [Request(input_token_ids=prompts[0], max_tokens=12, end_id=-1)])
        assert final_tokens(next(iter(alone.values()))) == expected[0]
        batched = run_all(ex, [Request(input_token_ids=p, max_tokens=12, end_id=-1) for p in prompts])
        chunked_iterations = [s for s in ex.get_latest_iteration_stats() if s.num_context_requests and
                              s.num_generation_requests]
    for got, want in zip(batched.values(), expected, strict=True):
        assert final_tokens(got) == want
    assert chunked_iterations, "context chunks never shared an iteration with generation steps"


@OVERLAP
def test_streaming_sends_every_token_once_in_order_and_is_final_once(tiny_llama: Path, overlap: bool) -> None:
    p = list(range(10, 30))
    with Executor.from_model(tiny_llama, config(overlap_scheduling=overlap)) as ex:
        full = run_all(ex, [Request(input_token_ids=p, max_tokens=20, end_id=-1)])
        streamed = run_all(ex, [Request(input_token_ids=p, max_tokens=20, end_id=-1, streaming=True)])
        cumulative = run_all(ex, [Request(input_token_ids=p, max_tokens=20, end_id=-1, streaming=True,
                                          return_all_generated_tokens=True)])
    (full_r,), stream_rs, cum_rs = *full.values(), *streamed.values(), *cumulative.values()
    assert full_r.result is not None and full_r.result.is_final
    assert len(stream_rs) == 20 and all(len(r.result.output_token_ids[0]) == 1 for r in stream_rs)  # type: ignore[union-attr]
    assert [r.result.is_final for r in stream_rs] == [False] * 19 + [True]  # type: ignore[union-attr]
    assert final_tokens(stream_rs) == full_r.result.output_token_ids[0]
    assert cum_rs[-1].result.output_token_ids[0] == full_r.result.output_token_ids[0]  # type: ignore[union-attr]
    assert [len(r.result.output_token_ids[0]) for r in cum_rs] == list(range(1, 21))  # type: ignore[union-attr]
    assert stream_rs[-1].result.finish_reasons == [FinishReason.LENGTH]  # type: ignore[union-attr]


@OVERLAP
def test_seeded_sampling_does_not_depend_on_the_batch(tiny_llama: Path, overlap: bool) -> None:
    rng = random.Random(2)
    sampling = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    target = Request(input_token_ids=prompt(rng, 9), max_tokens=16, end_id=-1, sampling_config=sampling)
    others = [Request(input_token_ids=prompt(rng, rng.randrange(2, 30)), max_tokens=16, end_id=-1,
                      sampling_config=SamplingConfig(temperature=0.7, seed=i)) for i in range(7)]
    with Executor.from_model(tiny_llama, config(overlap_scheduling=overlap)) as ex:
        alone = final_tokens(next(iter(run_all(ex, [target]).values())))
        mixed = run_all(ex, [*others[:3], target, *others[3:]])
        again = final_tokens(list(mixed.values())[3])
        greedy = final_tokens(next(iter(run_all(ex, [Request(input_token_ids=target.input_token_ids,
                                                               max_tokens=16, end_id=-1)]).values())))
    assert alone == again
    assert alone != greedy  # it really sampled


@OVERLAP
def test_cancel_mid_stream_ends_with_cancelled_and_frees_blocks(tiny_llama: Path, overlap: bool) -> None:
    with Executor.from_model(tiny_llama, config(overlap_scheduling=overlap)) as ex:
        total = ex.core.blocks.num_blocks
        rid = ex.enqueue_request(Request(input_token_ids=list(range(5, 50)), max_tokens=400, end_id=-1,
                                         streaming=True))
        first = ex.await_responses(rid, timeout=30)
        assert first and not first[0].result.is_final  # type: ignore[union-attr]
        ex.cancel_request(rid)
        responses = first
        while not responses[-1].result.is_final:  # type: ignore[union-attr]
            responses += ex.await_responses(rid, timeout=30)
        last = responses[-1].result
        assert last is not None and last.finish_reasons == [FinishReason.CANCELLED]
        assert len(final_tokens(responses)) < 400
        deadline = time.monotonic() + 5
        while ex.load()[2] != total and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ex.load() == (0, 0, total)


@pytest.mark.parametrize(
    ("request_kw", "message"),
    [
        (dict(input_token_ids=[]), "empty"),
        (dict(input_token_ids=[1, VOCAB_SIZE]), "outside the vocabulary"),
        (dict(input_token_ids=[-3]), "outside the vocabulary"),
        (dict(input_token_ids=[5] * 600), "exceeds the model's context"),
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(sampling_config=SamplingConfig(top_p=1.5)), "top_p must be in [0, 1]"),
        (dict(sampling_config=SamplingConfig(beam_width=4)), "beam_width 4 is outside"),
        (dict(stop_words=[[]]), "stop_words[0] is empty"),
    ],
)
def test_bad_input_gets_an_error_for_that_request_alone(tiny_llama: Path, request_kw: dict, message: str) -> None:
    kw = dict(input_token_ids=[5, 6, 7], max_tokens=4, end_id=-1) | request_kw
    with Executor.from_model(tiny_llama, config()) as ex:
        got = run_all(ex, [Request(input_token_ids=[9, 10], max_tokens=3, end_id=-1), Request(**kw),
                           Request(input_token_ids=[11, 12], max_tokens=3, end_id=-1)])
    good1, bad, good2 = got.values()
    assert bad[0].has_error and message in (bad[0].error_msg or ""), bad[0].error_msg
    assert len(final_tokens(good1)) == 3 and len(final_tokens(good2)) == 3


@OVERLAP
def test_end_id_stop_words_min_tokens_and_word_list_format(tiny_llama: Path, overlap: bool) -> None:
    p = list(range(20, 40))
    with Executor.from_model(tiny_llama, config(overlap_scheduling=overlap)) as ex:
        (free,) = run_all(ex, [Request(input_token_ids=p, max_tokens=12, end_id=-1)]).values()
        tokens = final_tokens(free)
        # end at the 5th generated token, unless min_tokens forbids it
        (ended,) = run_all(ex, [Request(input_token_ids=p, max_tokens=12, end_id=tokens[4])]).values()
        stop = [tokens[3], tokens[4]]
        (stopped,) = run_all(ex, [Request(input_token_ids=p, max_tokens=12, end_id=-1,
                                          stop_words=[[999 % VOCAB_SIZE, 7], stop])]).values()
        flat = PackedWordList([*stop, 5], [2, 3, -1])  # TensorRT-LLM [2, len]: words [t3, t4] and [5]
        (stopped_flat,) = run_all(ex, [Request(input_token_ids=p, max_tokens=12, end_id=-1,
                                               stop_words=flat)]).values()
    first_end = tokens.index(tokens[4])
    assert final_tokens(ended) == tokens[: first_end + 1]
    assert ended[-1].result.finish_reasons == [FinishReason.END_ID]  # type: ignore[union-attr]
    assert final_tokens(stopped)[-2:] == stop and stopped[-1].result.finish_reasons == [FinishReason.STOP_WORDS]  # type: ignore[union-attr]
    assert final_tokens(stopped_flat) == final_tokens(stopped)


@OVERLAP
def test_bad_words_and_min_tokens_change_the_output(tiny_llama: Path, overlap: bool) -> None:
    p = list(range(40, 60))
    with Executor.from_model(tiny_llama, config(overlap_scheduling=overlap)) as ex:
        (free,) = run_all(ex, [Request(input_token_ids=p, max_tokens=8, end_id=-1)]).values()
        tokens = final_tokens(free)
        (banned,) = run_all(ex, [Request(input_token_ids=p, max_tokens=8, end_id=-1,
                                         bad_words=[[tokens[0]]])]).values()
        (late,) = run_all(ex, [Request(input_token_ids=p, max_tokens=8, end_id=tokens[0],
                                       sampling_config=SamplingConfig(min_tokens=3))]).values()
    assert final_tokens(banned)[0] != tokens[0]
    assert len(final_tokens(late)) >= 3 and tokens[0] not in final_tokens(late)[:2]


def test_log_probs_and_prompt_echo(tiny_llama: Path) -> None:
    p = [7, 8, 9, 10]
    with Executor.from_model(tiny_llama, config()) as ex:
        (r,) = run_all(ex, [Request(input_token_ids=p, max_tokens=5, end_id=-1, output_config=OutputConfig(
            return_log_probs=True, exclude_input_from_output=False))]).values()
    result = r[0].result
    assert result is not None and result.output_token_ids[0][:4] == p and len(result.output_token_ids[0]) == 9
    assert result.log_probs is not None and len(result.log_probs[0]) == 5
    assert all(lp <= 0 for lp in result.log_probs[0])
    assert result.cum_log_probs is not None
    assert result.cum_log_probs[0] == pytest.approx(sum(result.log_probs[0]), rel=1e-5)


@OVERLAP
def test_num_return_sequences_each_sequence_gets_its_own_final_response(tiny_llama: Path, overlap: bool) -> None:
    with Executor.from_model(tiny_llama, config(overlap_scheduling=overlap)) as ex:
        (rs,) = run_all(ex, [Request(input_token_ids=[5, 6, 7], max_tokens=6, end_id=-1, num_return_sequences=3,
                                     sampling_config=SamplingConfig(temperature=1.0, seed=3))]).values()
    results = [r.result for r in rs]
    assert sorted(r.sequence_index for r in results) == [0, 1, 2]  # type: ignore[union-attr]
    assert all(r.is_sequence_final for r in results)  # type: ignore[union-attr]
    assert [r.is_final for r in results] == [False, False, True]  # type: ignore[union-attr]
    assert len({tuple(r.output_token_ids[0]) for r in results}) > 1  # type: ignore[union-attr]


@pytest.mark.parametrize("policy", list(CapacitySchedulerPolicy))
@OVERLAP
def test_kv_invariants_under_random_load_with_cancels_preemption_and_reuse(
    tiny_llama: Path, policy: CapacitySchedulerPolicy, overlap: bool
) -> None:
    rng = random.Random(3)
    prefixes = [prompt(rng, 24) for _ in range(3)]
    requests = []
    for _ in range(200):
        p = rng.choice(prefixes)[: rng.randrange(0, 25)] + prompt(rng, rng.randrange(1, 12))
        requests.append(Request(input_token_ids=p, max_tokens=rng.randrange(1, 20), end_id=-1,
                                streaming=rng.random() < 0.5))
    # The reference: a roomy cache, no reuse, so no preemption and no sharing.
    with Executor.from_model(tiny_llama, config(kv=KvCacheConfig(tokens_per_block=4, max_tokens=20000,
                                                      enable_block_reuse=False))) as ex:
        reference = [final_tokens(r) for r in run_all(ex, requests).values()]

    # A cache of 40 blocks (160 tokens) for up to 64 concurrent requests.
    tight = config(kv=KvCacheConfig(tokens_per_block=4, max_tokens=160), overlap_scheduling=overlap,
                   scheduler_config=SchedulerConfig(capacity_scheduler_policy=policy),
                   iteration_stats_max=1_000_000)  # every step's record: their preemptions are summed
    with Executor.from_model(tiny_llama, tight) as ex:
        cancel = set(rng.sample(range(len(requests)), 30))
        ids = ex.enqueue_requests(requests)
        for i in cancel:
            ex.cancel_request(ids[i])
        got = {i: [] for i in ids}  # type: dict[int, list]
        pending = set(ids)
        while pending:
            for r in ex.await_responses(timeout=60):
                got[r.request_id].append(r)
                if r.result.is_final:  # type: ignore[union-attr]
                    pending.discard(r.request_id)
        stats = ex.get_latest_iteration_stats()
        time.sleep(0.05)
        ex.core.blocks.check_invariants([])
        assert ex.core.blocks.num_free == ex.core.blocks.num_blocks
        preemptions = ex.core.scheduler.num_preemptions
    for k, (_rid, responses) in enumerate(got.items()):
        reason = responses[-1].result.finish_reasons[0]
        tokens = final_tokens(responses)
        if reason == FinishReason.CANCELLED:
            assert k in cancel and tokens == reference[k][: len(tokens)]
        else:
            assert tokens == reference[k], f"request {k} changed under preemption / reuse"
    assert stats[-1].reused_blocks > 0, "the shared prefixes were never reused"
    if policy is CapacitySchedulerPolicy.MAX_UTILIZATION:
        assert preemptions > 0, "the tight cache never forced a preemption"
    else:
        assert preemptions == 0
    assert sum(s.num_preempted for s in stats) == preemptions  # what the iteration stats report
