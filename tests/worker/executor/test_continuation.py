"""Continuations (protocol/continuation.py): a request sent again with the output
tokens already delivered generates exactly the rest of the undisturbed run's output,
whatever it is batched with (deterministic mode), under every option the rule admits;
and the continuations the rule refuses are errors for that request alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tests.worker.executor.helpers import final_tokens, run_all
from worker.executor import (
    DraftSource,
    Executor,
    ExecutorConfig,
    FinishReason,
    GuidedDecodingParams,
    KvCacheConfig,
    LoraConfig,
    PeftCacheConfig,
    Request,
    Response,
    SamplingConfig,
    SpeculativeConfig,
)

SEEDED = SamplingConfig(temperature=1.0, top_p=0.9, seed=8005)


def config(**kw: Any) -> ExecutorConfig:
    # 8 tokens a step: prompts and resumed tokens are computed in chunks, beside other requests' decodes.
    return ExecutorConfig(backend="numpy", deterministic=True, max_num_tokens=8,
                          kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=4096), **kw)


def requests() -> dict[str, Request]:
    prompt = [11, 52, 7, 300, 41, 9, 18]
    return {
        "greedy": Request(prompt, 16, streaming=True, end_id=-1),
        "seeded": Request(prompt, 16, streaming=True, end_id=-1, sampling_config=SEEDED),
        "penalties": Request([5, 5, 9, 5], 16, streaming=True, end_id=2, sampling_config=dataclasses.replace(
            SEEDED, presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3, min_tokens=12,
            no_repeat_ngram_size=2)),
        "guided": Request([5, 6, 7], 40, streaming=True, end_id=2, sampling_config=SEEDED,
                          guided_decoding_params=GuidedDecodingParams("regex", "(ab|cd)+!")),
        "speculation": Request(prompt * 3, 16, streaming=True, end_id=-1,
                               speculative_config=SpeculativeConfig(DraftSource.PROMPT_LOOKUP, 4)),
        "not streamed": Request(prompt, 12, end_id=-1, sampling_config=SEEDED),
    }


def last(responses: list[Response]) -> Response:
    assert not responses[-1].has_error, responses[-1].error_msg
    return responses[-1]


def only(got: dict[int, list[Response]]) -> list[Response]:
    (responses,) = got.values()
    return responses


Ending = tuple[list[int], list[FinishReason]]  # a run's tokens and finish reasons


def continued_at_cuts(ex: Executor, named: dict[str, Request]) -> dict[str, tuple[Ending, Ending]]:
    """Each request undisturbed, then continued from its first token, its middle and its
    last but one, all continuations in one batch: by "name after N tokens", what the
    continuation should give (the rest of the undisturbed run) and what it gave."""
    whole = dict(zip(named, run_all(ex, list(named.values())).values(), strict=True))
    continuations, wanted = [], []
    for name, request in named.items():
        tokens = final_tokens(whole[name])
        assert len(tokens) >= 3, f"{name}: too short to cut ({tokens})"
        for cut in sorted({1, len(tokens) // 2, len(tokens) - 1}):
            continuations.append(dataclasses.replace(request, resumed_token_ids=tokens[:cut]))
            # Streamed, the resumed tokens are not sent again; a single final result holds the whole output.
            rest = tokens[cut:] if request.streaming else tokens
            wanted.append((f"{name} after {cut} tokens", (rest, finish_reasons(whole[name]))))
    got = run_all(ex, continuations).values()
    return {label: (want, (final_tokens(responses), finish_reasons(responses)))
            for (label, want), responses in zip(wanted, got, strict=True)}  # fmt: skip


def finish_reasons(responses: list[Response]) -> list[FinishReason]:
    result = last(responses).result
    assert result is not None
    return result.finish_reasons


def test_continuations_generate_the_rest_of_the_undisturbed_output(tiny_llama: Path) -> None:
    pytest.importorskip("xgrammar", reason="guided decoding needs the `guided` extra")
    with Executor.from_model(tiny_llama, config()) as ex:
        outcomes = continued_at_cuts(ex, requests())
    assert {label.split(" after ")[0] for label in outcomes} == set(requests())
    for label, (want, got) in outcomes.items():
        assert got == want, label


def test_a_stop_word_across_the_resumed_boundary_ends_the_continuation(tiny_llama: Path) -> None:
    with Executor.from_model(tiny_llama, config()) as ex:
        plain = requests()["greedy"]
        tokens = final_tokens(only(run_all(ex, [plain])))
        stopped = dataclasses.replace(plain, stop_words=[tokens[5:8]])
        want = final_tokens(only(run_all(ex, [stopped])))
        assert want == tokens[:8]
        got = only(run_all(ex, [dataclasses.replace(stopped, resumed_token_ids=tokens[:6])]))
        assert final_tokens(got) == tokens[6:8]
        assert finish_reasons(got) == [FinishReason.STOP_WORDS]


def test_continuations_under_a_lora_adapter(tiny_llama: Path, lora_adapters: dict[str, Path]) -> None:
    adapters = {name: str(path) for name, path in lora_adapters.items()}
    with Executor.from_model(tiny_llama, config(lora_adapters=adapters,
                                                peft_cache_config=PeftCacheConfig(max_rank=8))) as ex:
        base = requests()["seeded"]
        outcomes = continued_at_cuts(ex, {n: dataclasses.replace(base, lora_config=LoraConfig(n)) for n in adapters})
    assert {label.split(" after ")[0] for label in outcomes} == set(adapters)
    for label, (want, got) in outcomes.items():
        assert got == want, label


@pytest.mark.parametrize(("change", "message"), [
    ({"sampling_config": SamplingConfig(beam_width=2)}, "a request with beam search cannot be continued"),
    ({"num_return_sequences": 2, "sampling_config": SEEDED}, "more than one returned sequence"),
    ({"resumed_token_ids": [3] * 16}, "max_tokens (16) leaves none to generate"),
    ({"resumed_token_ids": [3, 10**6]}, "resumed_token_ids: a token id outside the vocabulary"),
    ({"guided_decoding_params": GuidedDecodingParams("regex", "(ab|cd)+!"), "resumed_token_ids": [2]},
     "resumed_token_ids[0] (token 2) is not accepted by the request's grammar"),
])
def test_bad_continuations_fail_their_request_alone(tiny_llama: Path, change: dict[str, object],
                                                    message: str) -> None:
    if "guided_decoding_params" in change:
        pytest.importorskip("xgrammar", reason="guided decoding needs the `guided` extra")
    config_ = dataclasses.replace(config(), max_beam_width=2)
    good = Request([4, 5, 6], 16, end_id=-1)
    bad = dataclasses.replace(good, **{"resumed_token_ids": [3, 4], **change})  # type: ignore[arg-type]
    with Executor.from_model(tiny_llama, config_) as ex:
        refused, served = run_all(ex, [bad, good]).values()
    assert refused[-1].has_error and message in (refused[-1].error_msg or ""), refused[-1].error_msg
    assert len(final_tokens(served)) == 16
