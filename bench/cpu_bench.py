"""The executor on this machine's CPU against transformers' `generate`, same model and workload.

Workloads: (a) one request, (b) 32 concurrent requests, each 128 prompt tokens and
128 output tokens (EOS ignored). tokenwire runs its numpy backend; transformers runs
`generate` batched with left padding, fp32, greedy, on the same checkpoint.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

PROMPT_LEN = int(os.environ.get("TOKENWIRE_BENCH_PROMPT", "128"))
OUTPUT_LEN = int(os.environ.get("TOKENWIRE_BENCH_OUTPUT", "128"))
CONCURRENCY = (1, 32)
# 1: the executor in deterministic mode (docs/deterministic.md), to measure what it costs.
DETERMINISTIC = os.environ.get("TOKENWIRE_BENCH_DETERMINISTIC", "0") == "1"
TITLE = (f"Executor on this CPU vs transformers generate: default model, "
         f"{PROMPT_LEN} prompt / {OUTPUT_LEN} output tokens, "
         f"OpenBLAS kernels {os.environ.get('OPENBLAS_CORETYPE', 'detected from the CPU')}"
         f"{', deterministic mode' if DETERMINISTIC else ''}")


@dataclass(slots=True)
class Measurement:
    engine: str
    requests: int
    seconds: float
    output_tokens: int
    ttft_ms: float | None
    tpot_ms: float  # time per output token, per request, after the first

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def prompts(n: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, vocab) for _ in range(PROMPT_LEN)] for _ in range(n)]


def run_tokenwire(model_dir: Path, batch: list[list[int]]) -> Measurement:
    from worker.executor import Executor, ExecutorConfig, KvCacheConfig, Request

    config = ExecutorConfig(backend="numpy", max_batch_size=64, max_num_tokens=2048, deterministic=DETERMINISTIC,
                            kv_cache_config=KvCacheConfig(max_tokens=len(batch) * (PROMPT_LEN + OUTPUT_LEN) + 1024))
    with Executor.from_model(model_dir, config) as ex:
        # warm-up: first-call costs (allocation, BLAS thread start) stay out of the figures
        ex.enqueue_request(Request(input_token_ids=batch[0][:8], max_tokens=2, end_id=-1))
        while not any(r.result and r.result.is_final for r in ex.await_responses(timeout=60)):
            pass
        start = time.perf_counter()
        ids = ex.enqueue_requests(
            [Request(input_token_ids=p, max_tokens=OUTPUT_LEN, end_id=-1, streaming=True) for p in batch])
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        pending = set(ids)
        while pending:
            for r in ex.await_responses(timeout=600):
                now = time.perf_counter()
                assert r.result is not None, r.error_msg
                first.setdefault(r.request_id, now)
                last[r.request_id] = now
                if r.result.is_final:
                    pending.discard(r.request_id)
        seconds = time.perf_counter() - start
    ttft = sum(first[i] - start for i in ids) / len(ids)
    tpot = sum((last[i] - first[i]) / (OUTPUT_LEN - 1) for i in ids) / len(ids)
    return Measurement("tokenwire (numpy)", len(batch), seconds, len(batch) * OUTPUT_LEN, ttft * 1e3, tpot * 1e3)


def run_transformers(model_dir: Path, batch: list[list[int]]) -> Measurement:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(batch)  # every prompt has the same length: no padding needed
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:1, :8], attention_mask=mask[:1, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        seconds = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * len(batch)
    return Measurement("transformers generate", len(batch), seconds, produced, None,
                       seconds / OUTPUT_LEN * 1e3)


def measure() -> list[Measurement]:
    from worker.models.default_model import ensure_default_model
    from worker.models.loader import load_model

    model_dir = ensure_default_model()
    vocab = load_model(model_dir, load_weights=False).config.vocab_size
    rows = []
    for n in CONCURRENCY:
        batch = prompts(n, vocab)
        rows.append(run_tokenwire(model_dir, batch))
        rows.append(run_transformers(model_dir, batch))
    return rows


def table() -> tuple[list[str], list[list[str]]]:
    rows = measure()
    header = ["engine", "requests", "output tok/s", "TTFT ms", "time/output token ms", "vs transformers"]
    body = []
    for i in range(0, len(rows), 2):
        ours, peer = rows[i], rows[i + 1]
        for m in (ours, peer):
            body.append([
                m.engine, str(m.requests), f"{m.tokens_per_s:.1f}",
                "-" if m.ttft_ms is None else f"{m.ttft_ms:.0f}", f"{m.tpot_ms:.1f}",
                f"{m.tokens_per_s / peer.tokens_per_s:.2f}x",
            ])
    return header, body

