"""The engine core driven directly, with no thread: the same tokens as the Executor,
the caller's ids, and plain streamed steps in columns."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.checkpoints import VOCAB_SIZE
from tests.worker.executor.helpers import final_tokens, run_all
from worker.executor import (
    EngineCore,
    Executor,
    ExecutorConfig,
    FinishReason,
    KvCacheConfig,
    OutputConfig,
    Request,
    Response,
    SamplingConfig,
    SpeculativeConfig,
    StepOutput,
)


def config(**kw: object) -> ExecutorConfig:
    return ExecutorConfig(backend="numpy", kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=4096),
                          max_num_tokens=24, **kw)  # type: ignore[arg-type]


def drive(core: EngineCore) -> list[StepOutput]:
    """Step until the core has nothing left to do."""
    outputs: list[StepOutput] = []
    for _ in range(10_000):
        if not core.has_work:
            return outputs
        outputs.append(core.step())
    raise AssertionError("the core never ran out of work")


def responses_by_id(outputs: list[StepOutput]) -> dict[int, list[Response]]:
    by_id: dict[int, list[Response]] = {}
    for out in outputs:
        for r in out.all_responses():
            by_id.setdefault(r.request_id, []).append(r)
    return by_id


def streamed_tokens(responses: list[Response]) -> list[int]:
    return [t for r in responses if r.result is not None for t in r.result.output_token_ids[0]]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_step_driven_directly_gives_the_executors_greedy_tokens(tiny_llama: Path, overlap: bool) -> None:
    rng = random.Random(3)
    requests = [Request(input_token_ids=[rng.randrange(5, VOCAB_SIZE) for _ in range(rng.randrange(1, 40))],
                        max_tokens=10, end_id=-1) for _ in range(8)]
    with Executor.from_model(tiny_llama, config(overlap_scheduling=overlap)) as ex:
        want = [final_tokens(rs) for rs in run_all(ex, requests).values()]
    core = EngineCore.from_model(tiny_llama, config(overlap_scheduling=overlap))
    ids = [1000 + 7 * i for i in range(len(requests))]  # the caller's ids, answered as they are
    core.add_requests(zip(ids, requests, strict=True))
    got = responses_by_id(drive(core))
    assert sorted(got) == ids
    assert [final_tokens(got[i]) for i in ids] == want
    core.blocks.check_invariants([])  # every block back in the pool


def outcome(responses: list[Response]) -> list[tuple[int, list[list[int]]]]:
    """Every sequence's (or beam's) tokens, by sequence index."""
    got = []
    for r in responses:
        assert r.result is not None, r.error_msg
        got.append((r.result.sequence_index, r.result.output_token_ids))
    return sorted(got)


KINDS = {
    "seeded": dict(sampling_config=SamplingConfig(temperature=0.9, top_k=40, seed=11)),
    "n>1": dict(num_return_sequences=3, sampling_config=SamplingConfig(temperature=1.0, seed=5)),
    "beam": dict(sampling_config=SamplingConfig(beam_width=2)),
    "speculative": dict(speculative_config=SpeculativeConfig(num_draft_tokens=3)),
    "penalty": dict(sampling_config=SamplingConfig(temperature=0.8, repetition_penalty=1.3, seed=2)),
}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_step_driven_directly_gives_the_executors_tokens(tiny_llama: Path, kind: str, overlap: bool) -> None:
    rng = random.Random(5)
    # Repeated phrases, so prompt lookup finds drafts.
    prompts = [[rng.randrange(5, VOCAB_SIZE) for _ in range(4)] * rng.randrange(1, 5) for _ in range(5)]
    requests = [Request(input_token_ids=p, max_tokens=8, end_id=-1, **KINDS[kind]) for p in prompts]  # type: ignore[arg-type]
    cfg = config(overlap_scheduling=overlap, max_beam_width=2)
    with Executor.from_model(tiny_llama, cfg) as ex:
        want = [outcome(rs) for rs in run_all(ex, requests).values()]
    core = EngineCore.from_model(tiny_llama, cfg)
    ids = [50 + i for i in range(len(requests))]
    core.add_requests(zip(ids, requests, strict=True))
    got = responses_by_id(drive(core))
    assert [outcome(got[i]) for i in ids] == want
    assert all(len(w) == (3 if kind == "n>1" else 1) for w in want)
    core.blocks.check_invariants([])


def test_plain_streamed_steps_come_in_columns_and_everything_else_whole(tiny_llama: Path) -> None:
    core = EngineCore.from_model(tiny_llama, config())
    prompt = list(range(10, 30))
    core.add_requests([
        (1, Request(input_token_ids=prompt, max_tokens=6, end_id=-1, streaming=True)),
        (2, Request(input_token_ids=prompt, max_tokens=6, end_id=-1, streaming=True,
                    output_config=OutputConfig(return_log_probs=True))),
        (3, Request(input_token_ids=prompt, max_tokens=6, end_id=-1)),
        (4, Request(input_token_ids=prompt, max_tokens=6, end_id=-1, streaming=True, client_id=9)),
    ])
    outputs = drive(core)
    in_columns = {i for out in outputs for i in out.ids}
    whole = [r for out in outputs for r in out.responses]
    assert in_columns == {1}
    # Request 1: five streamed tokens in columns, then its final response whole.
    assert [r.request_id for r in whole if r.request_id == 1] == [1]
    assert sum(n for out in outputs for i, n in zip(out.ids, out.counts, strict=True) if i == 1) == 5
    assert [len([r for r in whole if r.request_id == i]) for i in (2, 3, 4)] == [6, 1, 6]
    by_id = responses_by_id(outputs)
    plain, with_log_probs = streamed_tokens(by_id[1]), streamed_tokens(by_id[2])
    assert plain == with_log_probs == final_tokens(by_id[3]) == streamed_tokens(by_id[4])
    assert sorted(s.request_id for out in outputs for s in out.request_stats) == [1, 2, 3, 4]


def test_an_id_already_in_flight_is_refused_alone(tiny_llama: Path) -> None:
    core = EngineCore.from_model(tiny_llama, config())
    core.add_requests([(5, Request(input_token_ids=[10, 11, 12], max_tokens=4, end_id=-1)),
                       (5, Request(input_token_ids=[13, 14], max_tokens=4, end_id=-1))])
    got = responses_by_id(drive(core))[5]
    errors = [r for r in got if r.error_msg is not None]
    assert len(errors) == 1 and "request id 5 is already in flight" in (errors[0].error_msg or "")
    finals = [r for r in got if r.result is not None and r.result.is_final]
    assert len(finals) == 1 and len(finals[0].result.output_token_ids[0]) == 4  # type: ignore[union-attr]


def test_abort_ends_a_request_with_cancelled_and_frees_its_blocks(tiny_llama: Path) -> None:
    core = EngineCore.from_model(tiny_llama, config())
    core.add_requests([(1, Request(input_token_ids=list(range(10, 40)), max_tokens=40, end_id=-1, streaming=True))])
    for _ in range(5):
        core.step()
    core.abort(1)
    final = [r for out in drive(core) for r in out.responses if r.request_id == 1]
    assert len(final) == 1 and final[0].result is not None
    assert final[0].result.is_final and final[0].result.finish_reasons == [FinishReason.CANCELLED]
    assert not core.has_work
    core.blocks.check_invariants([])  # every block back in the pool
