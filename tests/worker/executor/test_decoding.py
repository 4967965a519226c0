"""The decoding features of the Executor API end to end on tiny checkpoints,
with transformers as the oracle: beam search, log probs and logits outputs,
penalties, returned sequences, logits post-processors."""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.checkpoints import VOCAB_SIZE
from tests.worker.executor.helpers import _hf_model, final_tokens, hf_greedy, run_all
from worker.executor import (
    CapacitySchedulerPolicy,
    Executor,
    ExecutorConfig,
    FinishReason,
    KvCacheConfig,
    OutputConfig,
    Request,
    Response,
    SamplingConfig,
    SchedulerConfig,
)
from worker.executor.logits_processors import load_processors

OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
EARLY_STOPPING = {True: 1, False: 0, "never": -1}  # transformers' value -> ours (TensorRT-LLM's int)


def config(**kw: object) -> ExecutorConfig:
    kv = kw.pop("kv", KvCacheConfig(tokens_per_block=4, max_tokens=4096))
    return ExecutorConfig(backend="numpy", max_beam_width=4, kv_cache_config=kv, **kw)  # type: ignore[arg-type]


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, VOCAB_SIZE) for _ in range(n)]


def hf_generate(checkpoint: Path, tokens: list[int], **kw: Any) -> Any:
    import torch

    with torch.no_grad():
        return _hf_model(checkpoint).generate(
            torch.tensor([tokens]), do_sample=False, pad_token_id=0, return_dict_in_generate=True, **kw)


# -- beam search -----------------------------------------------------------------------

BeamCase = tuple[Request, list[list[int]], list[float]]


@pytest.fixture(scope="module")
def beams(tiny_llama: Path) -> list[BeamCase]:
    return beam_cases(tiny_llama)


def beam_cases(checkpoint: Path) -> list[BeamCase]:
    """(request, transformers' beams, transformers' beam scores): widths 2 and 4, every
    early-stopping mode, length penalties of both signs, an end token the beams meet."""
    rng = random.Random(5)
    cases = []
    for width, n, lp, es in [(2, 2, 1.0, True), (4, 3, 0.0, False), (4, 4, 2.0, "never"), (2, 1, -0.5, False),
                             (4, 2, 1.0, True), (2, 2, 0.5, "never")]:
        p = prompt(rng, rng.randrange(3, 20))
        eos = hf_greedy(checkpoint, p, 6)[rng.randrange(1, 6)]
        out = hf_generate(checkpoint, p, num_beams=width, num_return_sequences=n, length_penalty=lp, early_stopping=es,
                          max_new_tokens=12, eos_token_id=eos, output_scores=True)
        beams = []
        for row in out.sequences[:, len(p):].tolist():
            beams.append(row[: row.index(eos) + 1] if eos in row else row)
        request = Request(input_token_ids=p, max_tokens=12, end_id=eos, num_return_sequences=n,
                          sampling_config=SamplingConfig(beam_width=width, length_penalty=lp,
                                                         early_stopping=EARLY_STOPPING[es]),
                          output_config=OutputConfig(return_log_probs=True))
        cases.append((request, beams, out.sequences_scores.tolist()))
    return cases


@OVERLAP
def test_beam_search_matches_transformers_alone_and_batched(tiny_llama: Path, beams: list[BeamCase],
                                                           overlap: bool) -> None:
    cases = beams
    rng = random.Random(6)
    others = [Request(input_token_ids=prompt(rng, rng.randrange(2, 30)), max_tokens=10, end_id=-1) for _ in range(5)]
    with Executor.from_model(tiny_llama, config(overlap_scheduling=overlap, max_num_tokens=32)) as ex:
        alone = run_all(ex, [cases[0][0]])
        # Widths 2 and 4 together, with plain requests, prompts chunked: all served at once.
        batched = run_all(ex, [others[0], *(c[0] for c in cases), *others[1:]])
        ex.core.blocks.check_invariants([])
        assert ex.core.blocks.num_free == ex.core.blocks.num_blocks
    got = list(batched.values())[1 : 1 + len(cases)]
    assert next(iter(alone.values()))[-1].result.output_token_ids == cases[0][1]  # type: ignore[union-attr]
    for (request, want, scores), responses in zip(cases, got, strict=True):
        (r,) = responses
        result = r.result
        assert result is not None and result.is_final and result.sequence_index == 0
        assert result.output_token_ids == want
        lp = request.sampling_config.length_penalty
        assert result.cum_log_probs is not None
        ours = [c / len(t) ** lp for c, t in zip(result.cum_log_probs, want, strict=True)]  # type: ignore[operator]
        assert ours == pytest.approx(scores, abs=1e-4)
        ends = [FinishReason.END_ID if t[-1] == request.end_id else FinishReason.LENGTH for t in want]
        assert result.finish_reasons == ends
    plain = list(batched.values())
    for responses, other in zip([plain[0], *plain[1 + len(cases):]], others, strict=True):
        assert final_tokens(responses) == hf_greedy(tiny_llama, other.input_token_ids, 10)


def test_beam_search_under_preemption_keeps_its_result_and_the_kv_invariants(
    tiny_llama: Path, beams: list[BeamCase]
) -> None:
    cases = beams[:4]
    rng = random.Random(8)
    others = [Request(input_token_ids=prompt(rng, rng.randrange(8, 30)), max_tokens=16, end_id=-1) for _ in range(12)]
    tight = config(kv=KvCacheConfig(tokens_per_block=4, max_tokens=400),
                   scheduler_config=SchedulerConfig(capacity_scheduler_policy=CapacitySchedulerPolicy.MAX_UTILIZATION))
    with Executor.from_model(tiny_llama, tight) as ex:
        got = run_all(ex, [*(c[0] for c in cases), *others])
        time.sleep(0.05)
        ex.core.blocks.check_invariants([])
        assert ex.core.blocks.num_free == ex.core.blocks.num_blocks
        preemptions = ex.core.scheduler.num_preemptions
    results = list(got.values())
    for (_, want, _), responses in zip(cases, results[: len(cases)], strict=True):
        assert responses[-1].result.output_token_ids == want  # type: ignore[union-attr]
    for other, responses in zip(others, results[len(cases):], strict=True):
        assert final_tokens(responses) == hf_greedy(tiny_llama, other.input_token_ids, 16)
    assert preemptions > 0, "the tight cache never forced a preemption"


def test_streaming_beam_search_sends_running_beams_then_the_best(tiny_llama: Path, beams: list[BeamCase]) -> None:
    base, want_beams, _ = beams[1]
    request = replace(base, streaming=True)
    with Executor.from_model(tiny_llama, config()) as ex:
        (responses,) = run_all(ex, [request]).values()
    assert [r.result.is_final for r in responses] == [False] * (len(responses) - 1) + [True]  # type: ignore[union-attr]
    assert len(responses) > 2
    for step, r in enumerate(responses[:-1], start=1):
        assert len(r.result.output_token_ids) == request.num_return_sequences  # type: ignore[union-attr]
        assert all(len(t) == step for t in r.result.output_token_ids)  # type: ignore[union-attr]
    assert responses[-1].result.output_token_ids == want_beams  # type: ignore[union-attr]


# -- log probs and logits ---------------------------------------------------------------------

def test_log_probs_top_n_and_logits_match_transformers(tiny_llama: Path) -> None:
    import torch

    p = [7, 8, 9, 10, 11, 12, 13]
    out = hf_generate(tiny_llama, p, max_new_tokens=6, output_logits=True)
    want_tokens = out.sequences[0, len(p):].tolist()
    hf_logits = torch.cat(out.logits).float().numpy()
    hf_log_probs = torch.log_softmax(torch.from_numpy(hf_logits).double(), dim=-1).numpy()
    with torch.no_grad():
        hf_context = _hf_model(tiny_llama)(torch.tensor([p])).logits[0].float().numpy()
    request = Request(input_token_ids=p, max_tokens=6, end_id=-1, output_config=OutputConfig(
        return_log_probs=True, top_n_log_probs=3, return_context_logits=True, return_generation_logits=True))
    with Executor.from_model(tiny_llama, config()) as ex:
        (rs,) = run_all(ex, [request]).values()
    result = rs[-1].result
    assert result is not None and result.output_token_ids == [want_tokens]
    # Tolerance: float32 forward passes of two implementations differ by ~1e-5 in the logits.
    tol = 1e-4
    chosen = hf_log_probs[np.arange(6), want_tokens]
    assert result.log_probs is not None and np.allclose(result.log_probs[0], chosen, atol=tol)
    assert result.cum_log_probs is not None
    assert result.cum_log_probs[0] == pytest.approx(float(chosen.sum()), abs=6 * tol)
    assert result.top_token_ids is not None and result.top_log_probs is not None
    assert len(result.top_token_ids[0]) == 6
    for position, (ids, lps) in enumerate(zip(result.top_token_ids[0], result.top_log_probs[0], strict=True)):
        best = np.argsort(-hf_log_probs[position], kind="stable")[:3]
        assert ids == best.tolist()
        assert np.allclose(lps, hf_log_probs[position][best], atol=tol)
    assert np.asarray(result.generation_logits).shape == (1, 6, VOCAB_SIZE)
    assert np.allclose(np.asarray(result.generation_logits)[0], hf_logits, atol=tol)
    assert np.asarray(result.context_logits).shape == (len(p), VOCAB_SIZE)
    assert np.allclose(np.asarray(result.context_logits), hf_context, atol=tol)


# -- penalties ------------------------------------------------------------------------------------

@OVERLAP
def test_penalties_match_transformers_logits_processors(tiny_llama: Path, overlap: bool) -> None:
    rng = random.Random(9)
    prompts = [prompt(rng, rng.randrange(4, 16)) for _ in range(3)]
    bias_tokens = {11: 8.0, 12: 6.5}
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for p in prompts:
        greedy = hf_greedy(tiny_llama, p, 4)
        cases += [
            (dict(sampling_config=SamplingConfig(repetition_penalty=1.5)), dict(repetition_penalty=1.5)),
            (dict(sampling_config=SamplingConfig(repetition_penalty=0.6)), dict(repetition_penalty=0.6)),
            (dict(sampling_config=SamplingConfig(no_repeat_ngram_size=2)), dict(no_repeat_ngram_size=2)),
            (dict(sampling_config=SamplingConfig(min_tokens=5), end_id=greedy[1]),
             dict(min_new_tokens=5, eos_token_id=greedy[1])),
            (dict(embedding_bias=[bias_tokens.get(t, 0.0) for t in range(VOCAB_SIZE)]),
             dict(sequence_bias={(t,): b for t, b in bias_tokens.items()})),
        ]
    requests = []
    expected = []
    for k, (ours, theirs) in enumerate(cases):
        p = prompts[k // 5]
        requests.append(Request(input_token_ids=p, max_tokens=14, **{"end_id": -1, **ours}))
        out = hf_generate(tiny_llama, p, max_new_tokens=14, **theirs)
        row = out.sequences[0, len(p):].tolist()
        eos = theirs.get("eos_token_id")
        expected.append(row[: row.index(eos) + 1] if eos in row else row)
    with Executor.from_model(tiny_llama, config(overlap_scheduling=overlap)) as ex:
        got = run_all(ex, requests)
    for (ours, _), want, responses in zip(cases, expected, got.values(), strict=True):
        assert final_tokens(responses) == want, ours


def test_presence_and_frequency_penalties_stop_repeats(tiny_llama: Path) -> None:
    p = [20, 21, 22]
    with Executor.from_model(tiny_llama, config()) as ex:
        free, presence, frequency = (final_tokens(r) for r in run_all(ex, [
            Request(input_token_ids=p, max_tokens=24, end_id=-1),
            Request(input_token_ids=p, max_tokens=24, end_id=-1,
                    sampling_config=SamplingConfig(presence_penalty=100.0)),
            Request(input_token_ids=p, max_tokens=24, end_id=-1,
                    sampling_config=SamplingConfig(frequency_penalty=100.0)),
        ]).values())
    assert len(set(free)) < len(free), "the free run never repeated: the test shows nothing"
    assert len(set(presence)) == len(presence) and len(set(frequency)) == len(frequency)


# -- returned sequences ----------------------------------------------------------------------------

@OVERLAP
def test_num_return_sequences_stream_flags_shared_prompt_blocks_and_kv_invariants(
    tiny_llama: Path, overlap: bool
) -> None:
    p = list(range(30, 70))  # 10 blocks of 4 tokens
    request = Request(input_token_ids=p, max_tokens=6, end_id=-1, num_return_sequences=3, streaming=True,
                      sampling_config=SamplingConfig(temperature=1.0, seed=11),
                      output_config=OutputConfig(return_log_probs=True))
    with Executor.from_model(tiny_llama, config(overlap_scheduling=overlap)) as ex:
        (responses,) = run_all(ex, [request]).values()
        used = max(s.used_num_blocks for s in ex.get_latest_iteration_stats())
        time.sleep(0.05)
        ex.core.blocks.check_invariants([])
        assert ex.core.blocks.num_free == ex.core.blocks.num_blocks
    results = [r.result for r in responses]
    assert all(r is not None for r in results)
    # One response per sequence per token, each carrying its sequence index; the
    # last of each sequence is sequence-final, and only the very last is final.
    per_seq: dict[int, list] = {0: [], 1: [], 2: []}
    for r in results:
        per_seq[r.sequence_index].append(r)  # type: ignore[union-attr]
    for rs in per_seq.values():
        assert [x.is_sequence_final for x in rs] == [False] * 5 + [True]
        assert sum(len(x.output_token_ids[0]) for x in rs) == 6
    assert [r.is_final for r in results] == [False] * (len(results) - 1) + [True]  # type: ignore[union-attr]
    assert len({tuple(t for x in rs for t in x.output_token_ids[0]) for rs in per_seq.values()}) > 1
    # The prompt's 10 blocks are computed once and shared: 3 private copies would need 33+.
    assert used <= 10 + 3 * 2, used


def test_returned_sequences_equal_the_same_seeded_sequences_run_without_sharing(tiny_llama: Path) -> None:
    """Forking the prompt's blocks (and copying the shared partial block on write)
    gives each sequence exactly what computing its own prompt would."""
    p = list(range(100, 118))  # 4.5 blocks: the last is partial, so copied on write
    sampling = SamplingConfig(temperature=0.8, seed=21)
    with Executor.from_model(tiny_llama, config()) as ex:
        (shared,) = run_all(ex, [Request(input_token_ids=p, max_tokens=10, end_id=-1, num_return_sequences=4,
                                         sampling_config=sampling)]).values()
    with Executor.from_model(tiny_llama, config(kv=KvCacheConfig(tokens_per_block=4, max_tokens=4096,
                                                      enable_block_reuse=False))) as ex:
        # Ensure the reference really runs each sequence alone: no fork, one request per sequence.
        alone = []
        for index in range(4):
            ex_req = Request(input_token_ids=p, max_tokens=10, end_id=-1, num_return_sequences=index + 1,
                             sampling_config=sampling)
            (rs,) = run_all(ex, [ex_req]).values()
            alone.append(next(r.result.output_token_ids[0] for r in rs if r.result.sequence_index == index))  # type: ignore[union-attr]
    by_index = {r.result.sequence_index: r.result.output_token_ids[0] for r in shared}  # type: ignore[union-attr]
    assert [by_index[i] for i in range(4)] == alone


# -- logits post-processors -----------------------------------------------------------------------------

FORCED = 17


def force_token(request_id: int, logits: np.ndarray, tokens: list[list[int]], client_id: int | None) -> np.ndarray:
    out = np.full_like(logits, -np.inf)
    out[:, FORCED if client_id is None else client_id] = 0.0
    return out


def ban_previous_batched(ids: list[int], logits: list[np.ndarray], tokens: list[list[list[int]]],
                         client_ids: list[int | None]) -> None:
    for row, toks in zip(logits, tokens, strict=True):
        row[0, toks[0][-1]] = -np.inf  # never repeat the last token


def broken(request_id: int, logits: np.ndarray, tokens: list[list[int]], client_id: int | None) -> np.ndarray:
    raise RuntimeError("boom")


@OVERLAP
def test_logits_post_processors_named_batched_failing_and_unknown(tiny_llama: Path, overlap: bool) -> None:
    # One processor as a callable, the others by import path, as a service's config names them.
    processors = load_processors([f"force={__name__}:force_token"])
    by_path = (f"batched={__name__}:ban_previous_batched", f"broken={__name__}:broken")
    p = [40, 41, 42]
    with Executor.from_model(tiny_llama, config(overlap_scheduling=overlap, logits_post_processor_map=processors,
                                     logits_post_processors=by_path)) as ex:
        got = list(run_all(ex, [
            Request(input_token_ids=p, max_tokens=5, end_id=-1, logits_post_processor_name="force"),
            Request(input_token_ids=p, max_tokens=5, end_id=-1, logits_post_processor_name="force", client_id=23),
            Request(input_token_ids=p, max_tokens=12, end_id=-1, logits_post_processor_name="batched",
                    sampling_config=SamplingConfig(repetition_penalty=0.01)),  # would repeat without the processor
            Request(input_token_ids=p, max_tokens=5, end_id=-1, logits_post_processor_name="broken"),
            Request(input_token_ids=p, max_tokens=5, end_id=-1, logits_post_processor_name="nope"),
            Request(input_token_ids=p, max_tokens=5, end_id=-1),
        ]).values())
    assert final_tokens(got[0]) == [FORCED] * 5
    assert final_tokens(got[1]) == [23] * 5
    batched = final_tokens(got[2])
    assert all(a != b for a, b in itertools.pairwise(batched))
    assert got[3][-1].has_error and "'broken' failed: RuntimeError: boom" in (got[3][-1].error_msg or "")
    assert got[4][0].has_error and "unknown logits post-processor 'nope'" in (got[4][0].error_msg or "")
    assert final_tokens(got[5]) == hf_greedy(tiny_llama, p, 5)


def test_load_processors_rejects_bad_specs() -> None:
    with pytest.raises(ValueError, match=r"expected 'name=package\.module:function'"):
        load_processors(["force"])
    with pytest.raises(ValueError, match="cannot import"):
        load_processors(["x=no.such.module:f"])
    with pytest.raises(ValueError, match="is not callable"):
        load_processors([f"x={__name__}:FORCED"])


@pytest.mark.parametrize(
    ("request_kw", "message"),
    [
        (dict(sampling_config=SamplingConfig(beam_width=2), num_return_sequences=3), "must not exceed"),
        (dict(sampling_config=SamplingConfig(beam_width=8)), "beam_width 8 is outside"),
        (dict(sampling_config=SamplingConfig(repetition_penalty=0.0)), "repetition_penalty must be > 0"),
        (dict(embedding_bias=[0.0, 1.0]), "embedding_bias has 2 values"),
        (dict(output_config=OutputConfig(top_n_log_probs=1000)), "top_n_log_probs must be in"),
        (dict(sampling_config=SamplingConfig(beam_width=2), output_config=OutputConfig(top_n_log_probs=2)),
         "not supported with beam search"),
    ],
)
def test_bad_decoding_input_gets_an_error_for_that_request_alone(
    tiny_llama: Path, request_kw: dict, message: str
) -> None:
    kw = dict(input_token_ids=[5, 6, 7], max_tokens=4, end_id=-1) | request_kw
    with Executor.from_model(tiny_llama, config()) as ex:
        good1, bad, good2 = run_all(ex, [Request(input_token_ids=[9, 10], max_tokens=3, end_id=-1), Request(**kw),
                                         Request(input_token_ids=[11, 12], max_tokens=3, end_id=-1)]).values()
    assert bad[0].has_error and message in (bad[0].error_msg or ""), bad[0].error_msg
    assert len(final_tokens(good1)) == 3 and len(final_tokens(good2)) == 3


@pytest.mark.parametrize("policy", list(CapacitySchedulerPolicy))
def test_kv_invariants_with_beams_and_returned_sequences_under_load_and_cancels(
    tiny_llama: Path, policy: CapacitySchedulerPolicy
) -> None:
    rng = random.Random(12)
    shared = prompt(rng, 13)
    requests = []
    for k in range(36):
        p = shared[: rng.randrange(0, 14)] + prompt(rng, rng.randrange(1, 10))
        kind = k % 3
        if kind == 0:
            cfg = SamplingConfig(beam_width=rng.choice([2, 4]), length_penalty=1.0)
            requests.append(Request(input_token_ids=p, max_tokens=rng.randrange(1, 12), end_id=-1, sampling_config=cfg,
                                    num_return_sequences=rng.randrange(1, cfg.beam_width + 1)))
        elif kind == 1:
            requests.append(Request(input_token_ids=p, max_tokens=rng.randrange(1, 12), end_id=-1,
                                    num_return_sequences=rng.randrange(2, 4), streaming=rng.random() < 0.5,
                                    sampling_config=SamplingConfig(temperature=0.9, seed=k)))
        else:
            requests.append(Request(input_token_ids=p, max_tokens=rng.randrange(1, 12), end_id=-1))
    with Executor.from_model(tiny_llama, config(kv=KvCacheConfig(tokens_per_block=4, max_tokens=20000,
                                                      enable_block_reuse=False))) as ex:
        reference = [outputs(r) for r in run_all(ex, requests).values()]
    tight = config(kv=KvCacheConfig(tokens_per_block=4, max_tokens=240),
                   scheduler_config=SchedulerConfig(capacity_scheduler_policy=policy))
    with Executor.from_model(tiny_llama, tight) as ex:
        ids = ex.enqueue_requests(requests)
        cancel = set(rng.sample(range(len(requests)), 8))
        for i in cancel:
            ex.cancel_request(ids[i])
        got = {i: [] for i in ids}  # type: dict[int, list[Response]]
        pending = set(ids)
        while pending:
            for r in ex.await_responses(timeout=60):
                assert r.request_id in pending, "a response after the final one"
                got[r.request_id].append(r)
                if r.has_error or r.result.is_final:  # type: ignore[union-attr]
                    pending.discard(r.request_id)
        time.sleep(0.05)
        ex.core.blocks.check_invariants([])
        assert ex.core.blocks.num_free == ex.core.blocks.num_blocks
        preemptions = ex.core.scheduler.num_preemptions
    cancelled = 0
    for k, responses in enumerate(got.values()):
        assert all(not r.has_error for r in responses), responses[-1].error_msg
        if FinishReason.CANCELLED in responses[-1].result.finish_reasons:  # type: ignore[union-attr]
            assert k in cancel
            cancelled += 1
            continue
        assert outputs(responses) == reference[k], f"request {k} changed under a tight cache"
    assert cancelled, "every cancel came too late: the test shows little"
    if policy is CapacitySchedulerPolicy.MAX_UTILIZATION:
        assert preemptions > 0, "the tight cache never forced a preemption"


def outputs(responses: list[Response]) -> dict[int, list[list[int]]]:
    """sequence index -> its beams, streamed tokens gathered (beam search never streams here)."""
    got: dict[int, list[list[int]]] = {}
    for r in responses:
        assert r.result is not None, r.error_msg
        beams = r.result.output_token_ids
        if len(beams) == 1:
            got.setdefault(r.result.sequence_index, [[]])[0] += beams[0]
        else:
            got[r.result.sequence_index] = [list(b) for b in beams]
    return got


def test_cancelled_beam_search_ends_once_with_cancelled_and_frees_its_blocks(tiny_llama: Path) -> None:
    request = Request(input_token_ids=list(range(50, 70)), max_tokens=300, end_id=-1, streaming=True,
                      num_return_sequences=2, sampling_config=SamplingConfig(beam_width=4))
    with Executor.from_model(tiny_llama, config()) as ex:
        rid = ex.enqueue_request(request)
        responses = ex.await_responses(rid, timeout=30)
        ex.cancel_request(rid)
        while not responses[-1].result.is_final:  # type: ignore[union-attr]
            responses += ex.await_responses(rid, timeout=30)
        time.sleep(0.05)
        assert ex.load()[1] == 0
        ex.core.blocks.check_invariants([])
        assert ex.core.blocks.num_free == ex.core.blocks.num_blocks
    last = responses[-1].result
    assert last is not None and last.finish_reasons == [FinishReason.CANCELLED] * 2
    assert len(last.output_token_ids) == 2 and 0 < len(last.output_token_ids[0]) < 300
    assert sum(r.result.is_final for r in responses) == 1  # type: ignore[union-attr]


def test_overlap_drops_scheduled_sequences_that_ended_in_flight(tiny_llama: Path) -> None:
    """A batch that must see its latest tokens (here: multi-token bad words)
    first completes the step in flight; a sequence that token ended leaves the
    batch already scheduled."""
    rng = random.Random(13)
    prompts = [prompt(rng, 6) for _ in range(8)]
    ends = [hf_greedy(tiny_llama, p, 4)[2] for p in prompts]
    requests = [Request(input_token_ids=p, max_tokens=10, end_id=e) for p, e in zip(prompts, ends, strict=True)]
    requests.append(Request(input_token_ids=[5, 6, 7], max_tokens=10, end_id=-1, bad_words=[[8, 9]]))
    with Executor.from_model(tiny_llama, config(overlap_scheduling=True)) as ex:
        got = list(run_all(ex, requests).values())
        ex.core.blocks.check_invariants([])
    for responses, p, e in zip(got[:-1], prompts, ends, strict=True):
        tokens = final_tokens(responses)
        assert tokens[-1] == e and tokens == hf_greedy(tiny_llama, p, len(tokens))
    assert len(final_tokens(got[-1])) == 10
