"""The executor over pipeline stages (gloo, on the CPU), alone and under tensor
parallelism (TP=2 x PP=2: 4 ranks): rank 0 runs the core and the last stage, each step
is cut into micro-batches that pass from stage to stage. Greedy tokens equal one
process's and transformers', generation logits within 1e-4 of one process's; beams,
penalties, seeded sampling, top-N, bad words, chunked context, a cancel and preemption
give what one process gives, and so does speculative verification; stages of unequal
layer counts agree on the KV blocks; prompt-tuning rows reach the first stage's
embedding in their micro-batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.worker.executor.helpers import final_tokens, hf_greedy, run_all
from tests.worker.executor.test_decoding_backends import outputs, requests
from tests.worker.parallel.executors import parallel_executor as executor
from worker.executor import (
    CapacitySchedulerPolicy,
    DraftSource,
    FinishReason,
    KvCacheConfig,
    OutputConfig,
    PromptTuningConfig,
    Request,
    Response,
    SamplingConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from worker.parallel.ranks import DistributedBackend


def _prompts() -> list[list[int]]:
    return [list(range(7, 30)), [5, 9, 200, 31], list(range(100, 140, 3))]


def _greedy(model: Path, tp: int, pp: int, micro_batches: int = 0) -> tuple[list[list[int]], np.ndarray]:
    """Every prompt's greedy tokens, and the first's generation logits. Prompts longer
    than max_num_tokens go in chunks beside the others' generation."""
    reqs = [Request(input_token_ids=p, max_tokens=8, end_id=-1, sampling_config=SamplingConfig(temperature=0.0),
                    output_config=OutputConfig(return_generation_logits=i == 0))
            for i, p in enumerate(_prompts())]  # fmt: skip
    with executor(model, tp, pp, micro_batches, max_num_tokens=16) as ex:
        got = list(run_all(ex, reqs).values())
    logits = got[0][-1].result.generation_logits  # type: ignore[union-attr]
    return [final_tokens(r) for r in got], np.asarray(logits)


@pytest.mark.parametrize(
    ("name", "tp", "pp", "micro_batches"),
    [
        ("llama_gqa", 1, 2, 0),
        ("llama_gqa", 1, 2, 3),  # every sequence a micro-batch of its own
        ("mistral_bf16_sharded", 1, 2, 0),  # sliding-window layers keep their window on their stage
        # One KV head under 2 tensor-parallel ranks, on each of 2 stages.
        ("qwen2_mqa", 2, 2, 0),
    ],
)
def test_greedy_equals_one_process_and_transformers(name: str, tp: int, pp: int, micro_batches: int,
                                                    tiny_checkpoints: dict[str, Path]) -> None:  # fmt: skip
    model = tiny_checkpoints[name]
    tokens, logits = _greedy(model, tp, pp, micro_batches)
    want_tokens, want_logits = _greedy(model, 1, 1)
    assert tokens == want_tokens
    np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=0)
    assert tokens == [hf_greedy(model, p, 8) for p in _prompts()]


def test_stages_of_unequal_layers_agree_on_the_kv_blocks(three_layer_qwen2: Path) -> None:
    """3 layers on 2 stages: rank 0's holds 1, the other 2. The KV bytes per token the core
    plans with are the larger stage's, so the block count fits every rank."""
    tokens, logits = _greedy(three_layer_qwen2, 1, 2)
    want_tokens, want_logits = _greedy(three_layer_qwen2, 1, 1)
    assert tokens == want_tokens
    np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=0)
    with executor(three_layer_qwen2, 1, 2) as ex:
        backend = ex.core.backend
        assert isinstance(backend, DistributedBackend)
        assert backend.inner.kv_bytes_per_token() * 2 == backend.kv_bytes_per_token()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_decoding_features_cancels_and_preemption_equal_one_process(tp: int, pp: int, tiny_llama: Path) -> None:
    """Every decoding feature, plus requests that outgrow a small KV pool (the newest
    are preempted and recomputed), and one cancelled while it runs."""
    long = [Request(input_token_ids=[60 + i, 61, 62, 63, 64, 65], max_tokens=30, end_id=-1,
                    sampling_config=SamplingConfig(temperature=0.0)) for i in range(4)]  # fmt: skip
    policy = SchedulerConfig(CapacitySchedulerPolicy.MAX_UTILIZATION)

    def run(tp: int, pp: int) -> tuple[list[object], FinishReason]:
        with executor(tiny_llama, tp, pp, kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=96),
                      scheduler_config=policy) as ex:  # fmt: skip
            doomed = Request(input_token_ids=[3, 4, 5], max_tokens=80, end_id=-1, streaming=True)
            ids = ex.enqueue_requests([doomed, *requests(), *long])
            got: dict[int, list[Response]] = {i: [] for i in ids}
            pending = set(ids)
            while pending:
                for r in ex.await_responses(timeout=60):
                    if r.request_id == ids[0] and not got[ids[0]]:
                        ex.cancel_request(ids[0])
                    got[r.request_id].append(r)
                    if r.has_error or (r.result is not None and r.result.is_final):
                        pending.discard(r.request_id)
            final = got[ids[0]][-1].result
            assert final is not None
            assert ex.core.scheduler.num_preemptions > 0
            return [outputs(got[i]) for i in ids[1:]], final.finish_reasons[0]

    got, cancelled = run(tp, pp)
    want, _ = run(1, 1)
    assert got == want
    assert cancelled == FinishReason.CANCELLED



@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_speculative_verification_equals_plain_greedy(tp: int, pp: int, tiny_llama: Path) -> None:
    """Verification steps (several query tokens a sequence, rejected drafts rolled back)
    run on every rank and stage: verifying drafts gives one process's plain greedy tokens.
    The drafts are that output with one token wrong, so some are accepted, the rest not."""

    def run(tp: int, pp: int, drafts: list[list[int]] | None) -> tuple[list[list[int]], int]:
        reqs = [Request(input_token_ids=p, max_tokens=12, end_id=-1, sampling_config=SamplingConfig(temperature=0.0),
                        speculative_config=None if drafts is None else SpeculativeConfig(
                            DraftSource.DRAFT_TOKENS, 4, draft_tokens=drafts[i]))
                for i, p in enumerate(_prompts())]  # fmt: skip
        with executor(tiny_llama, tp, pp) as ex:
            tokens = [final_tokens(r) for r in run_all(ex, reqs).values()]
            accepted = sum(s.num_accepted_draft_tokens for s in ex.get_latest_iteration_stats())
        return tokens, accepted

    want, _ = run(1, 1, None)
    drafts = [[*t[:6], (t[6] + 1) % 200, *t[7:]] for t in want]
    tokens, accepted = run(tp, pp, drafts)
    assert 0 < accepted < sum(len(t) for t in want)
    assert tokens == want

def test_prompt_tuning_rows_reach_the_first_stage(tiny_llama: Path) -> None:
    """Table rows equal to the vocabulary's embeddings of the ids they replace decode as
    those ids, among other sequences (in a micro-batch after the first)."""
    embed = load_file(tiny_llama / "model.safetensors")["model.embed_tokens.weight"]
    prompt = list(range(40, 52))
    tuned = list(prompt)
    for row, p in enumerate([9, 2, 5]):
        tuned[p] = embed.shape[0] + row
    table = np.stack([embed[prompt[p]] for p in [9, 2, 5]])
    greedy = SamplingConfig(temperature=0.0)
    # The prefill step's micro-batches: [prompt] and [short, tuned] (its rows past the cut).
    reqs = [Request(input_token_ids=prompt, max_tokens=6, end_id=-1, sampling_config=greedy),
            Request(input_token_ids=[7, 8, 9], max_tokens=6, end_id=-1, sampling_config=greedy),
            Request(input_token_ids=tuned, max_tokens=6, end_id=-1, sampling_config=greedy,
                    prompt_tuning_config=PromptTuningConfig(table))]  # fmt: skip
    with executor(tiny_llama, 1, 2) as ex:
        got = [final_tokens(r) for r in run_all(ex, reqs).values()]
    assert got[2] == got[0] == hf_greedy(tiny_llama, prompt, 6)
