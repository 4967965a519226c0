"""lm-evaluation-harness as a real client of the HTTP front: its `local-completions`
model on a multiple-choice (loglikelihood) task and a generate-until task, and its
`local-chat-completions` model on the generate-until one, against a real gateway and
worker serving the tiny checkpoint. The tasks and their data live in lm_eval_tasks/."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.gateway.http_service import http_service

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (the `test` extra)")

MODEL = "tiny-llama-long"
TASKS = Path(__file__).parent / "lm_eval_tasks"
# The per-choice sums of a few float32 log probs: two implementations differ by ~1e-5 a token.
TOL = 1e-3


@pytest.fixture(scope="module")
def service(long_model, redis_server, tmp_path_factory):
    with http_service(long_model, redis_server.url, tmp_path_factory.mktemp("lm-eval")) as s:
        yield s


def evaluate(model, task: str, monkeypatch, **kwargs):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(TASKS)  # the task YAMLs name their data relative to here
    results = simple_evaluate(model=model, tasks=[task], task_manager=TaskManager(include_path=str(TASKS)),
                              log_samples=True, **kwargs)  # fmt: skip
    assert results is not None
    return results


def completions_model(service, long_model):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(model=MODEL, base_url=f"{service.http_url}/v1/completions", num_concurrent=1,
                               max_retries=1, tokenizer_backend="huggingface", tokenizer=str(long_model),
                               tokenized_requests=True)  # fmt: skip


def hf_continuation_log_prob(hf_model, context: list[int], continuation: list[int]) -> float:
    import torch

    tokens = context + continuation
    with torch.no_grad():
        rows = torch.log_softmax(hf_model(torch.tensor([tokens])).logits[0].double(), dim=-1)
    return float(sum(rows[len(context) + i - 1, t] for i, t in enumerate(continuation)))


def test_local_completions_loglikelihood_matches_transformers(service, long_model, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    lm = completions_model(service, long_model)
    results = evaluate(lm, "tokenwire_tiny_mc", monkeypatch)
    acc = results["results"]["tokenwire_tiny_mc"]["acc,none"]
    assert isinstance(acc, float) and 0.0 <= acc <= 1.0
    samples = results["samples"]["tokenwire_tiny_mc"]
    assert len(samples) == 4
    hf_model = AutoModelForCausalLM.from_pretrained(long_model, dtype=torch.float32).eval()
    checked = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            got, _is_greedy = resp[0]
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            want = hf_continuation_log_prob(hf_model, context_ids, continuation_ids)
            assert math.isfinite(float(got))
            assert float(got) == pytest.approx(want, abs=TOL * len(continuation_ids))
            checked += 1
    assert checked == sum(len(s["doc"]["choices"]) for s in samples)


def check_generate_until(results: dict) -> None:
    from lm_eval.models.api_models import LMEVAL_MODEL_NONE_ANSWER_PLACEHOLDER

    score = results["results"]["tokenwire_tiny_gen"]["exact_match,none"]
    assert isinstance(score, float) and 0.0 <= score <= 1.0
    samples = results["samples"]["tokenwire_tiny_gen"]
    assert len(samples) == 3
    for sample in samples:
        (text,) = sample["filtered_resps"]
        # lm-eval puts a placeholder where a reply had no content; a failed request raises
        assert isinstance(text, str) and text != LMEVAL_MODEL_NONE_ANSWER_PLACEHOLDER
        assert "\n" not in text  # cut at the stop string


def test_local_completions_generate_until(service, long_model, monkeypatch):
    check_generate_until(evaluate(completions_model(service, long_model), "tokenwire_tiny_gen", monkeypatch))


def test_local_chat_completions_generate_until(service, monkeypatch):
    from lm_eval.models.openai_completions import LocalChatCompletion

    lm = LocalChatCompletion(model=MODEL, base_url=f"{service.http_url}/v1/chat/completions", num_concurrent=1,
                             max_retries=1, tokenizer_backend=None, tokenized_requests=False)  # fmt: skip
    check_generate_until(evaluate(lm, "tokenwire_tiny_gen", monkeypatch, apply_chat_template=True))
