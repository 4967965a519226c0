"""Speculative decoding on vs off, same engine core, model and run.

Workload: input-grounded "repeat / edit this code" chat prompts on the default
model (greedy; each request ends at EOS or max tokens), B concurrent requests
for B in the batch sizes. Modes, taking turns on the same prompts:
  off          ordinary decoding (overlap scheduling as usual)
  lookup       prompt lookup (n-gram match over prompt + output, no model)
  draft-model  a draft model made of the target's first --draft-layers layers
               (a shallower copy of the same model: it shows the mechanics and
               costs; a distilled small model would accept far more)
Verification steps run in CUDA graphs (worker/backends/cuda_graphs.py), captured
before the runs with the decode graphs, for the target and the draft model.
Per row: the decode time per output token of one request (wall time after every
request's first token, divided by the tokens each request produced after its
first, averaged over the requests), output tokens/s over the whole run, the
acceptance rate (draft tokens accepted / verified), the engine steps the run
took, whether the output equals the off run's token for token, and the speedup
of the time per output token over off. The fastest of --repeats runs counts.

    python3 -m bench.spec_bench                 # GPU: batch 1 and 8, 256 tokens
    python3 -m bench.spec_bench --batches 1 --max-tokens 24   # a quick CPU check

Needs only numpy, torch (on a GPU), safetensors and tokenizers. The model: --model
(a checkpoint directory or .gguf), default the default model from the tokenwire
model cache (XDG_CACHE_HOME/tokenwire/models).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench import SkipSection

TITLE = "speculative decoding: prompt lookup and a draft model vs off, code-editing prompts"

SNIPPETS = [
    '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def factorial(n):
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result
''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]

    def __len__(self):
        return len(self.items)
''',
    '''def merge_sorted(left, right):
    out = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i])
            i += 1
        else:
            out.append(right[j])
            j += 1
    out.extend(left[i:])
    out.extend(right[j:])
    return out
''',
    '''import json


def load_config(path):
    with open(path) as f:
        config = json.load(f)
    config.setdefault("host", "127.0.0.1")
    config.setdefault("port", 8080)
    config.setdefault("debug", False)
    return config


def save_config(path, config):
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
''',
]
INSTRUCTIONS = [
    "Repeat this code exactly, without any change:",
    "Rewrite this code with the variable names in snake_case and nothing else changed:",
    "Add type hints to this code and return the whole code:",
    "Copy this code and add a short comment above each function:",
]


def prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """n ChatML chat prompts (the default model's template), each a code snippet and an edit instruction."""
    out = []
    for i in range(n):
        code = SNIPPETS[i % len(SNIPPETS)]
        instruction = INSTRUCTIONS[(i // len(SNIPPETS) + i) % len(INSTRUCTIONS)]
        text = (f"<|im_start|>system\nYou are a helpful coding assistant.<|im_end|>\n"
                f"<|im_start|>user\n{instruction}\n\n```python\n{code}```<|im_end|>\n<|im_start|>assistant\n")
        out.append(list(tokenizer.encode(text, add_special_tokens=False).ids))
    return out


_RUNS = itertools.count(1)


@dataclass(slots=True)
class Measured:
    mode: str
    batch: int
    seconds: float
    decode_ms_per_token: float  # per request, after its first token
    output_tokens: int
    drafted: int
    accepted: int
    steps: int  # engine iterations
    tokens: list[list[int]]


def run_once(core: Any, reqs: list[Any]) -> Measured:
    """Drive the core until every request ended (no thread: what the engine process runs)."""
    n = len(reqs)
    tokens: list[list[int]] = [[] for _ in range(n)]
    first: list[float | None] = [None] * n
    last: list[float] = [0.0] * n
    drafted = accepted = steps = 0
    base = 10_000 * next(_RUNS)  # fresh ids per run
    start = time.perf_counter()
    core.add_requests((base + i, r) for i, r in enumerate(reqs))
    while core.has_work:
        out = core.step()
        now = time.perf_counter()
        for r in out.all_responses():
            assert r.result is not None, r.error_msg
            i = r.request_id - base
            new = r.result.output_token_ids[0]
            if new:
                if first[i] is None:
                    first[i] = now
                last[i] = now
                tokens[i] += new
        for it in out.iteration_stats:
            drafted += it.num_draft_tokens
            accepted += it.num_accepted_draft_tokens
            steps += 1
    seconds = time.perf_counter() - start
    per_token = [(last[i] - (first[i] or last[i])) / (len(tokens[i]) - 1) for i in range(n) if len(tokens[i]) > 1]
    return Measured("", n, seconds, 1e3 * sum(per_token) / max(1, len(per_token)),
                    sum(len(t) for t in tokens), drafted, accepted, steps, tokens)


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    """(engine core with the draft model attached, tokenizer)."""
    from worker.backends.device import create_backend
    from worker.executor import EngineCore, ExecutorConfig, KvCacheConfig
    from worker.executor.draft_model import DraftModel, first_layers
    from worker.models.loader import load_model

    path = args.model
    if path is None:
        from worker.models.default_model import DefaultModelUnavailable, ensure_default_gguf

        try:
            path = ensure_default_gguf()
        except DefaultModelUnavailable as e:
            raise SkipSection(f"default model unavailable: {e}") from e
    loaded = load_model(path)
    max_batch = max(args.batches)
    kv_tokens = max_batch * (1024 + args.max_tokens + 64) + 4096
    cfg = ExecutorConfig(backend=args.backend, device=args.device, dtype=args.dtype, max_batch_size=max_batch,
                         max_num_tokens=args.max_num_tokens,
                         kv_cache_config=KvCacheConfig(tokens_per_block=32, max_tokens=kv_tokens))
    layers = args.draft_layers or max(1, loaded.config.num_layers // 4)
    draft_model = load_model(args.draft_model) if args.draft_model else first_layers(loaded, layers)
    draft = DraftModel.from_loaded(draft_model, cfg.backend, cfg.device, cfg.dtype, cfg.max_num_tokens, max_batch)
    backend = create_backend(loaded, cfg.backend, cfg.device, cfg.dtype, max_num_tokens=cfg.max_num_tokens,
                             max_batch_size=max_batch)
    core = EngineCore(backend, cfg, tokenizer=loaded.tokenizer, draft=draft)
    _capture_graphs([backend, draft.backend], max_batch)
    args.draft_name = args.draft_model or f"the first {layers} of {loaded.config.num_layers} layers"
    args.backend_name = backend.name
    return core, loaded.tokenizer


def _capture_graphs(backends: list[Any], max_batch: int) -> None:
    """Every verification CUDA graph a run may use, before any is timed (the decode graphs are
    captured with the KV cache)."""
    from worker.backends.torch_backend import TorchBackend

    for backend in backends:
        if isinstance(backend, TorchBackend):
            backend.capture_verification_graphs(max_batch)


def measure(args: argparse.Namespace) -> tuple[list[str], list[list[str]]]:
    from worker.executor import DraftSource, Request, SpeculativeConfig

    core, tokenizer = build(args)
    modes: dict[str, SpeculativeConfig | None] = {
        "off": None,
        "lookup": SpeculativeConfig(DraftSource.PROMPT_LOOKUP, args.lookup_k),
        "draft-model": SpeculativeConfig(DraftSource.DRAFT_MODEL, args.draft_k),
    }
    pool = prompts(tokenizer, max(args.batches))
    rows = []
    for batch in args.batches:
        best: dict[str, Measured] = {}
        for repeat in range(args.repeats + 1):  # the first round warms up (graphs, kernels)
            for mode, spec in modes.items():
                reqs = [Request(input_token_ids=p, max_tokens=args.max_tokens, streaming=True, speculative_config=spec)
                        for p in pool[:batch]]
                m = run_once(core, reqs)
                m.mode = mode
                if repeat and (mode not in best or m.decode_ms_per_token < best[mode].decode_ms_per_token):
                    best[mode] = m
        off = best["off"]
        for mode, m in best.items():
            same = sum(a == b for a, b in zip(m.tokens, off.tokens, strict=True))
            rows.append([
                str(batch), mode,
                f"{m.decode_ms_per_token:.3f}",
                f"{m.output_tokens / m.seconds:.0f}",
                f"{m.accepted / m.drafted:.0%}" if m.drafted else "-",
                str(m.steps),
                f"{same}/{batch}",
                f"{off.decode_ms_per_token / m.decode_ms_per_token:.2f}x",
            ])
    header = ["batch", "mode", "ms/token", "tok/s", "accepted", "steps", "identical", "speedup"]
    return header, rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory or .gguf (default: the default model)")
    p.add_argument("--backend", default="auto", choices=["auto", "numpy", "torch"])
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma-separated batch sizes (default 1,8 on a GPU, 1,2 elsewhere)")
    p.add_argument("--max-tokens", type=int, default=None, help="per request (default 256 on a GPU, 24 elsewhere)")
    p.add_argument("--max-num-tokens", type=int, default=4096)
    p.add_argument("--lookup-k", type=int, default=8, help="draft tokens per step, prompt lookup")
    p.add_argument("--draft-k", type=int, default=4, help="draft tokens per step, draft model")
    p.add_argument("--draft-layers", type=int, default=0,
                   help="the draft model: the target's first N layers (default: a quarter of them)")
    p.add_argument("--draft-model", default=None, help="a draft checkpoint to use instead (same tokenizer)")
    p.add_argument("--repeats", type=int, default=2, help="measured runs per mode (after one warm-up)")
    return p


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    from worker.backends.device import cuda_available

    gpu = args.backend != "numpy" and cuda_available()
    if args.batches is None:
        args.batches = [1, 8] if gpu else [1, 2]
    if args.max_tokens is None:
        args.max_tokens = 256 if gpu else 24
    return args


def table() -> tuple[list[str], list[list[str]]]:
    """The bench/run.py section, with the defaults (TOKENWIRE_BENCH_SPEC_ARGS adds options)."""
    args = _defaults(parser().parse_args(os.environ.get("TOKENWIRE_BENCH_SPEC_ARGS", "").split()))
    return measure(args)


def main(argv: list[str] | None = None) -> int:
    from bench.run import format_table

    args = _defaults(parser().parse_args(argv))
    header, rows = measure(args)
    print(f"# {TITLE}")
    print(f"# backend {args.backend_name}, draft model = {args.draft_name}, lookup k={args.lookup_k}, "
          f"draft k={args.draft_k}, max {args.max_tokens} tokens, greedy; fastest of {args.repeats} runs")
    print(format_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
