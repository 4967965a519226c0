"""Shared by the executor tests: run requests to completion, and the transformers oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from worker.executor import Executor, Request, Response


def run_all(executor: Executor, requests: list[Request], timeout: float = 120.0) -> dict[int, list[Response]]:
    """Enqueue everything, collect every response until each request is final."""
    ids = executor.enqueue_requests(requests)
    responses: dict[int, list[Response]] = {i: [] for i in ids}
    pending = set(ids)
    while pending:
        got = executor.await_responses(timeout=timeout)
        assert got, f"no response within {timeout} s; still pending: {sorted(pending)}"
        for r in got:
            responses[r.request_id].append(r)
            if r.has_error or (r.result is not None and r.result.is_final):
                pending.discard(r.request_id)
    return {i: responses[i] for i in ids}


def final_tokens(responses: list[Response]) -> list[int]:
    """All generated tokens of a (single-sequence) request, whether it streamed or not."""
    tokens: list[int] = []
    for r in responses:
        assert r.result is not None, r.error_msg
        tokens += r.result.output_token_ids[0]
    return tokens


def hf_greedy(checkpoint: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation, never stopping at EOS."""
    import torch

    model = _hf_model(checkpoint)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
        )
    return list(out[0, len(prompt) :].tolist())


_MODELS: dict[Path, object] = {}


def _hf_model(checkpoint: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    if checkpoint not in _MODELS:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        model.generation_config.eos_token_id = None
        _MODELS[checkpoint] = model.eval()
    return _MODELS[checkpoint]
