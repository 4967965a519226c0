"""Decoding features against plain sampling, same executor, model and run.

Workloads on the default model (the backend `auto` picks: torch on CUDA, else
numpy), each a few concurrent requests of one chat prompt: plain sampling
(EOS ignored), guided JSON-schema decoding (XGrammar; ends when the JSON
does), and beam search of width 4 (EOS ignored). Output tokens/s counts the
tokens returned (the best beam's, for beam search); sequence tokens/s counts
every token the model computed a step for (all beams).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from bench import SkipSection

REQUESTS = int(os.environ.get("TOKENWIRE_BENCH_DECODING_REQUESTS", "4"))
MAX_TOKENS = int(os.environ.get("TOKENWIRE_BENCH_DECODING_TOKENS", "48"))
BEAM_WIDTH = 4
TITLE = (f"Decoding features vs plain sampling: default model, {REQUESTS} concurrent requests, "
         f"up to {MAX_TOKENS} output tokens")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@dataclass(slots=True)
class Run:
    workload: str
    seconds: float
    output_tokens: int
    sequence_tokens: int


def _prompt(executor: object) -> list[int]:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = executor.chat_template  # type: ignore[attr-defined]
    messages = [{"role": "user", "content": "Describe a person as JSON with their name, age and city."}]
    text = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template).render(
        messages=messages, add_generation_prompt=True)
    return list(executor.tokenizer.encode(text, add_special_tokens=False).ids)  # type: ignore[attr-defined]


def _run(executor: object, workload: str, requests: list[object], width: int) -> Run:
    start = time.perf_counter()
    ids = executor.enqueue_requests(requests)  # type: ignore[attr-defined]
    pending, output = set(ids), 0
    while pending:
        for r in executor.await_responses(timeout=600):  # type: ignore[attr-defined]
            if r.error_msg is not None:
                raise RuntimeError(f"{workload}: {r.error_msg}")
            if r.result.is_final:
                pending.discard(r.request_id)
                output += len(r.result.output_token_ids[0])
    seconds = time.perf_counter() - start
    return Run(workload, seconds, output, output * width)


def measure() -> list[Run]:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        raise SkipSection("needs xgrammar (the `guided` extra)") from None
    from worker.executor import (
        Executor,
        ExecutorConfig,
        GuidedDecodingParams,
        KvCacheConfig,
        Request,
        SamplingConfig,
    )
    from worker.models.default_model import DefaultModelUnavailable, ensure_default_gguf

    try:
        model = ensure_default_gguf()
    except DefaultModelUnavailable as e:
        raise SkipSection(f"default model unavailable: {e}") from None
    config = ExecutorConfig(max_beam_width=BEAM_WIDTH, kv_cache_config=KvCacheConfig(max_tokens=16384))
    with Executor.from_model(model, config) as ex:
        prompt = _prompt(ex)
        guide = GuidedDecodingParams("json_schema", json.dumps(SCHEMA))

        def sampled(seed: int, **kw: object) -> Request:
            return Request(input_token_ids=prompt, max_tokens=MAX_TOKENS,
                           sampling_config=SamplingConfig(temperature=0.8, seed=seed), **kw)  # type: ignore[arg-type]

        _run(ex, "warm-up", [sampled(0, end_id=-1, guided_decoding_params=guide)], 1)
        return [
            _run(ex, "plain sampling", [sampled(i, end_id=-1) for i in range(REQUESTS)], 1),
            _run(ex, "guided JSON schema", [sampled(i, guided_decoding_params=guide) for i in range(REQUESTS)], 1),
            _run(ex, f"beam search, width {BEAM_WIDTH}", [
                Request(input_token_ids=prompt, max_tokens=MAX_TOKENS, end_id=-1,
                        sampling_config=SamplingConfig(beam_width=BEAM_WIDTH)) for _ in range(REQUESTS)], BEAM_WIDTH),
        ]


def table() -> tuple[list[str], list[list[str]]]:
    runs = measure()
    plain = runs[0].output_tokens / runs[0].seconds
    header = ["workload", "output tokens", "seconds", "output tok/s", "vs plain", "sequence tok/s"]
    rows = [[r.workload, str(r.output_tokens), f"{r.seconds:.2f}", f"{r.output_tokens / r.seconds:.1f}",
             f"{r.output_tokens / r.seconds / plain:.2f}x", f"{r.sequence_tokens / r.seconds:.1f}"] for r in runs]
    return header, rows
