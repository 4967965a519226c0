"""The launcher's wait rule on real launched steps: which steps must complete
before the next is scheduled, and which batches wait for the step in flight."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.executor import (
    EngineCore,
    ExecutorConfig,
    KvCacheConfig,
    OutputConfig,
    Request,
    SamplingConfig,
    SpeculativeConfig,
)
from worker.executor.launcher import InFlight

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]


def first_step(model: Path, request: Request, overlap: bool = True) -> tuple[EngineCore, InFlight]:
    """A core with `request` added and its first step launched, not completed."""
    core = EngineCore.from_model(model, ExecutorConfig(
        backend="numpy", kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024),
        overlap_scheduling=overlap, max_beam_width=2))
    core.add_requests([(1, request)])
    batch = core.scheduler.schedule()
    return core, core.launcher.launch(batch, core.siblings.fork(batch))


@pytest.mark.parametrize(
    ("request_kw", "waits"),
    [
        ({}, False),
        (dict(num_return_sequences=2, sampling_config=SamplingConfig(temperature=1.0)), False),
        (dict(sampling_config=SamplingConfig(beam_width=2)), True),  # the beam step picks the next beams
        (dict(output_config=OutputConfig(return_generation_logits=True)), True),  # sampled on the host
        (dict(speculative_config=SpeculativeConfig(num_draft_tokens=3)), True),  # drafts follow its token
    ],
    ids=["plain", "n>1", "beam", "host", "speculating"],
)
def test_a_step_the_next_schedule_depends_on_completes_before_it(tiny_llama: Path, request_kw: dict,
                                                                 waits: bool) -> None:
    core, step = first_step(tiny_llama, Request(input_token_ids=PROMPT, max_tokens=8, end_id=-1, **request_kw))
    assert core.launcher.must_complete_first(step, None) is waits


def test_without_overlap_every_step_completes_before_the_next(tiny_llama: Path) -> None:
    core, step = first_step(tiny_llama, Request(input_token_ids=PROMPT, max_tokens=8, end_id=-1), overlap=False)
    assert core.launcher.must_complete_first(step, None)


@pytest.mark.parametrize(
    ("sampling", "waits"),
    [
        (SamplingConfig(), False),
        (SamplingConfig(repetition_penalty=1.3), True),  # its inputs count the latest token
        (SamplingConfig(no_repeat_ngram_size=2), True),
    ],
    ids=["plain", "penalty", "no-repeat"],
)
def test_a_batch_that_reads_the_token_in_flight_waits_for_it(tiny_llama: Path, sampling: SamplingConfig,
                                                             waits: bool) -> None:
    core, step = first_step(tiny_llama, Request(input_token_ids=PROMPT, max_tokens=8, end_id=-1,
                                                sampling_config=sampling))
    assert not core.launcher.must_complete_first(step, None)
    following = core.scheduler.schedule()  # the generation step after it, its token a placeholder
    assert [s.num_pending for s in following.seqs] == [1]
    assert core.launcher.must_complete_first(step, following) is waits


def test_a_host_batch_waits_for_the_step_in_flight(tiny_llama: Path) -> None:
    core, step = first_step(tiny_llama, Request(input_token_ids=PROMPT, max_tokens=8, end_id=-1))
    core.add_requests([(2, Request(input_token_ids=PROMPT, max_tokens=8, end_id=-1,
                                   output_config=OutputConfig(return_context_logits=True)))])
    assert core.launcher.must_complete_first(step, core.scheduler.schedule())
