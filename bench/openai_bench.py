"""The OpenAI-compatible HTTP front under load: what chat with tools and the Responses
API cost per output token next to plain chat, and a standard load generator's report
(GuideLLM) beside bench.serving_bench's for the same workload.

Cost: N requests of P prompt / O output tokens (greedy, EOS held off where the route
takes `ignore_eos`), C at a time, for each of three workloads on the same stack:
plain /v1/chat/completions, the same with two tool definitions and tool_choice
"auto" (the prompt carries the rendered tools; the reply is parsed for tool calls),
and /v1/responses, after a warm-up of each, in rounds (the best run of each kept). Per-token
cost is the run's wall time over its output tokens; the ratio is against plain chat (the
goal: at most 3 % more).

Load generator: GuideLLM streams the same N requests to /v1/chat/completions, all at
once (concurrency N), from synthetic prompts of P tokens; bench.serving_bench's service
path sends its N requests at once too (its "burst" rate) through the ZeroMQ client.

    python -m bench.openai_bench                          # the default model
    python -m bench.openai_bench --model tiny --requests 16   # the CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import SkipSection, default_model, vocab_size
from bench.service_stack import Stack
from bench.stream_timing import pct

TITLE = "openai: chat with tools and the Responses API against plain chat; GuideLLM beside serving_bench"
TOOLS: list[Any] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {
            "type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
]  # fmt: skip


def prompt_text(words: int, i: int) -> str:
    # A new text per request, so no request is served from another's prefix cache.
    return f"request {i}: " + " ".join(f"word{(i * 7919 + j) % 1000}" for j in range(words))


async def _timed(n: int, concurrency: int, one: Callable[[int], Awaitable[int]]) -> tuple[float, int]:
    """Run one(i) for i < n, `concurrency` at a time; (wall seconds, output tokens)."""
    gate = asyncio.Semaphore(concurrency)

    async def bounded(i: int) -> int:
        async with gate:
            return await one(i)

    start = time.perf_counter()
    tokens = await asyncio.gather(*(bounded(i) for i in range(n)))
    return time.perf_counter() - start, sum(tokens)


async def cost_rows(base_url: str, served: str, args: argparse.Namespace) -> list[list[str]]:
    import openai

    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600) as client:
        hold = {"ignore_eos": True}

        async def chat(i: int) -> int:
            r = await client.chat.completions.create(
                model=served, messages=[{"role": "user", "content": prompt_text(args.prompt, i)}],
                max_tokens=args.output, temperature=0.0, extra_body=hold)  # fmt: skip
            return r.usage.completion_tokens if r.usage else 0

        async def tools(i: int) -> int:
            r = await client.chat.completions.create(
                model=served, messages=[{"role": "user", "content": prompt_text(args.prompt, i)}],
                max_tokens=args.output, temperature=0.0, tools=TOOLS, tool_choice="auto", extra_body=hold)  # fmt: skip
            return r.usage.completion_tokens if r.usage else 0

        async def responses(i: int) -> int:
            r = await client.responses.create(model=served, input=prompt_text(args.prompt, i),
                                              max_output_tokens=args.output, temperature=0.0, store=False)  # fmt: skip
            return r.usage.output_tokens if r.usage else 0

        workloads = (("chat", chat), ("chat + tools", tools), ("responses", responses))
        for _, one in workloads:  # warm-up, unreported: every route's first requests
            await _timed(args.concurrency, args.concurrency, one)
        # Rounds of all three, the best of each kept: a load change on the machine mid-run
        # then shows in one round's figures, not in one workload's.
        best: dict[str, tuple[float, int]] = {}
        for _ in range(args.rounds):
            for name, one in workloads:
                seconds, tokens = await _timed(args.requests, args.concurrency, one)
                if name not in best or seconds / max(tokens, 1) < best[name][0] / max(best[name][1], 1):
                    best[name] = (seconds, tokens)
        rows, base = [], None
        for name, _ in workloads:
            seconds, tokens = best[name]
            per_token = seconds / max(tokens, 1) * 1e3
            base = base or per_token
            rows.append([name, str(args.requests), str(args.concurrency), str(tokens), f"{seconds:.2f}",
                         f"{per_token:.3f}", f"{per_token / base:.3f}"])  # fmt: skip
    return rows


COST_HEADER = ["workload", "requests", "concurrency", "output tokens", "seconds", "ms / output token", "vs chat"]


def guidellm_row(base_url: str, tokenizer: Path, args: argparse.Namespace) -> list[str]:
    guidellm = shutil.which("guidellm", path=os.path.dirname(sys.executable)) or shutil.which("guidellm")
    if guidellm is None:
        raise SkipSection("guidellm is not installed (the `test` extra)")
    with tempfile.TemporaryDirectory(prefix="tokenwire-guidellm-") as tmp:
        report = Path(tmp) / "benchmarks.json"
        run = subprocess.run(
            [guidellm, "run",
             "--backend", f"kind=openai_http,target={base_url},model={tokenizer.name},"
                          "request_format=/v1/chat/completions,stream=true",
             "--profile", f"kind=concurrent,streams={args.requests}",
             "--constraint", f"kind=max_requests,count={args.requests}",
             "--data", f"kind=synthetic_text,prompt_tokens={args.prompt},output_tokens={args.output}",
             "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
             "--output", f"kind=json,path={report}", "--disable-console-interactive"],
            capture_output=True, text=True, timeout=1800, cwd=tmp)  # fmt: skip
        if run.returncode != 0:
            raise RuntimeError(f"guidellm failed:\n{run.stderr[-2000:]}")
        (benchmark,) = json.loads(report.read_text())["benchmarks"]
    m = benchmark["metrics"]
    totals = m["request_totals"]
    if totals["errored"] or totals["incomplete"]:
        raise RuntimeError(f"guidellm reported failed requests: {totals}")

    def ok(name: str) -> dict[str, Any]:
        summary: dict[str, Any] = m[name]["successful"]
        return summary

    ttft, itl, rate = ok("time_to_first_token_ms"), ok("inter_token_latency_ms"), ok("output_tokens_per_second")
    return ["guidellm (HTTP, streamed chat)", str(totals["successful"]), f"{rate['mean']:,.0f}",
            f"{ttft['median']:.1f}", f"{ttft['percentiles']['p99']:.1f}",
            f"{itl['median']:.2f}", f"{itl['percentiles']['p99']:.2f}"]  # fmt: skip


def serving_row(stack: Stack, vocab: int, args: argparse.Namespace) -> list[str]:
    from bench.serving_bench import prompts_for, service_run

    r, _ = service_run(stack.gateway, "bench", prompts_for(args.requests, args.prompt, vocab, 7), args.output,
                       float("inf"), seed=0)  # fmt: skip
    return ["serving_bench (ZeroMQ, streamed)", str(r.requests), f"{r.tok_s:,.0f}", f"{pct(r.ttft_ms, 50):.1f}",
            f"{pct(r.ttft_ms, 99):.1f}", f"{pct(r.itl_ms, 50):.2f}", f"{pct(r.itl_ms, 99):.2f}"]  # fmt: skip


LOAD_HEADER = ["tool", "requests", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]


def model_path(name: str, directory: Path) -> Path:
    from bench.serving_bench import tiny_checkpoint
    if name == "tiny":
        return tiny_checkpoint(directory / "tiny")
    return default_model() if name == "default" else Path(name)


def run(args: argparse.Namespace) -> tuple[list[list[str]], list[list[str]]]:
    with tempfile.TemporaryDirectory(prefix="tokenwire-openai-bench-") as tmp:
        model = model_path(args.model, Path(tmp))
        vocab = vocab_size(model)
        stack = Stack(model)
        try:
            base_url = f"http://127.0.0.1:{stack.http_port}"
            cost = asyncio.run(cost_rows(base_url, model.name, args))  # the service names a model by its directory
            load = [guidellm_row(base_url, model, args), serving_row(stack, vocab, args)]
        finally:
            stack.close()
    return cost, load


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="default, tiny, or a checkpoint directory")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128, help="prompt words (cost) / tokens (load generators)")
    p.add_argument("--output", type=int, default=64, help="output tokens per request")
    p.add_argument("--rounds", type=int, default=3, help="cost runs of every workload; the best of each is shown")
    return p


def table() -> tuple[list[str], list[list[str]]]:
    """`make bench` section: the cost table (the load table prints with `python -m bench.openai_bench`)."""
    cost, _ = run(parser().parse_args([]))
    return COST_HEADER, cost


def main() -> None:
    from bench.run import format_table

    cost, load = run(parser().parse_args())
    print(format_table(COST_HEADER, cost))
    print()
    print(format_table(LOAD_HEADER, load))


if __name__ == "__main__":
    main()
