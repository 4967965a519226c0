"""The service path against the executor in process, same workload, same run.

(a) On the default model: N concurrent streaming requests of P prompt tokens and
O output tokens (EOS banned with min_tokens) on an Executor in this process and
through one gateway and one worker on loopback (real processes, a private Redis),
taking turns: each of TOKENWIRE_BENCH_SERVICE_REPEATS sets of new prompts (default
3) runs in process, then through the service, on one warm Executor and one warm
stack, and the fastest run of each path is shown. Output tokens/s, TTFT and inter-token latency (p50 / p99),
measured where the tokens arrive: the await loop, or the client library. ITL
is given over all gaps and over the decode phase alone (gaps that began once
every stream had its first token): before that, a gap may hold a step that
carries prompt chunks, and which streams wait through those depends on the
order the requests arrived in, not on the transport.
The same stack's HTTP front (OpenAI's /v1/completions, server-sent events, a
plain asyncio HTTP/1.1 client here so the figures are the server's, not an SDK's)
takes its turn after the ZeroMQ client on each set, with prompts that differ in
their first token (the worker's prefix cache must not serve the second path).
A second stack, the same but with CURVE on between client, gateway and worker
(its own worker: same prompts; all stacks start at once), runs right next to
the first on each set, the two taking turns at going first (its row).
CURVE's cost is then measured on up to TOKENWIRE_BENCH_SERVICE_CURVE_PAIRS more
sets (default 150; fewer where they would take longer than _CURVE_BUDGET_S,
default 180 s, but at least two): one run of 0.3 s on the GPU host swings by
tens of percent, so one ratio says nothing about a 3 % goal (on the H100 host
30 sets gave a 95 % interval of 0.84-1.06, 150 sets 0.94-1.02). On each set the
plain stack, the CURVE stack and a third stack (plain again: the A/A control,
which has run each earlier set after the HTTP run, so all three are as warm)
each run once, their order going through all six permutations in turn; CURVE on
vs off and plain vs plain are given as the ratio of the total tokens/s over all
sets (with a 95 % bootstrap interval over the sets), the median of the per-set
ratios and their interquartile range, and the CPU time per token of each stack's
gateway and worker process and of the client. The control's figures are the
noise floor of the same method.
(b) TRANSPORT TEST: a worker started with `--backend echo` (its backend returns
immediately, no model runs) behind one gateway, to find how many streamed
tokens/s one gateway process routes (detokenizing as usual). Each row also says
the CPU time per token of the gateway process and of the client (this process):
on a machine whose cores the worker, the gateway and the client share, tokens/s
is their sum's ceiling, and the CPU figures say whose share is what.

The first echo workload runs again with CURVE on: CURVE's cost where the transport bounds the rate.

(c) API keys + limits on the HTTP front, measured as CURVE is but with one worker
for all: three gateways on one stack's Redis, in front of its one worker (keys off,
keys on with a key stored in Redis whose limits (concurrency, requests and tokens
per minute) are set far above the load, so every request takes the limits' path,
and keys off again as the A/A control), so the runs differ by the gateway alone.
Each set of prompts runs once through each gateway's /v1/completions (every client
sends the same Authorization header; each gateway's prompts differ in their first
token, so none is served from another's prefix cache), orders permuted; up to
TOKENWIRE_BENCH_SERVICE_KEYS_PAIRS sets (default 300) within
TOKENWIRE_BENCH_SERVICE_KEYS_BUDGET_S (default 150 s, at least two sets), each run
TOKENWIRE_BENCH_SERVICE_KEYS_OUTPUT tokens a stream (default _OUTPUT; longer runs
average out more of a run's swing). Beside the ratio of tokens/s and its interval,
each gateway's CPU time per streamed token (from /proc): the cost itself, which
does not swing with the model's pace.

Sizes: TOKENWIRE_BENCH_SERVICE_REQUESTS, _PROMPT, _OUTPUT (_REPEATS,
_CURVE_PAIRS, _CURVE_BUDGET_S above), _ECHO ("64x1024,256x512": the echo
workloads, streams x tokens; _ECHO_CLIENTS, _ECHO_WORKERS and _ECHO_GATEWAYS: client
processes, echo workers and gateway processes for the rows that find one gateway's
ceiling); the defaults are 64 x 128 / 128 (on a 2-core CPU about five minutes for the
first sets' runs, and the CURVE comparison's budget). All processes share this machine's cores, so the service
path's figures include the gateway's and the client's use of the cores the model
runs on.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from bench import default_model, vocab_size
from bench.http_stream import stream_completion
from bench.process_cpu import cpu_seconds
from bench.service_stack import Front, Stack
from bench.stream_timing import Timeline, pct
from ops.process import settle_gc

if TYPE_CHECKING:
    from ops.curve import ClientCurve
    from worker.executor import Executor

TITLE = "service: in process vs gateway + worker on loopback; gateway transport ceiling"
REQUESTS = int(os.environ.get("TOKENWIRE_BENCH_SERVICE_REQUESTS", "64"))
PROMPT = int(os.environ.get("TOKENWIRE_BENCH_SERVICE_PROMPT", "128"))
OUTPUT = int(os.environ.get("TOKENWIRE_BENCH_SERVICE_OUTPUT", "128"))
REPEATS = int(os.environ.get("TOKENWIRE_BENCH_SERVICE_REPEATS", "3"))
CURVE_PAIRS = max(2, int(os.environ.get("TOKENWIRE_BENCH_SERVICE_CURVE_PAIRS", "150")))  # quartiles need two
CURVE_BUDGET_S = float(os.environ.get("TOKENWIRE_BENCH_SERVICE_CURVE_BUDGET_S", "180"))
KEYS_PAIRS = max(2, int(os.environ.get("TOKENWIRE_BENCH_SERVICE_KEYS_PAIRS", "300")))
KEYS_BUDGET_S = float(os.environ.get("TOKENWIRE_BENCH_SERVICE_KEYS_BUDGET_S", "150"))
KEYS_OUTPUT = int(os.environ.get("TOKENWIRE_BENCH_SERVICE_KEYS_OUTPUT", str(OUTPUT)))
# (concurrent streams, tokens each), as "64x1024,256x512"
# Client processes for the echo rows that measure the gateway rather than one client (1: none).
ECHO_CLIENTS = int(os.environ.get("TOKENWIRE_BENCH_SERVICE_ECHO_CLIENTS", "1"))
# And echo workers behind the one gateway for a second pair of them (1: none).
ECHO_WORKERS = int(os.environ.get("TOKENWIRE_BENCH_SERVICE_ECHO_WORKERS", "1"))
# Gateway processes behind the several echo workers (the client processes spread over their ports).
ECHO_GATEWAYS = int(os.environ.get("TOKENWIRE_BENCH_SERVICE_ECHO_GATEWAYS", "1"))
ECHO_WORKLOADS = tuple(
    (int(n), int(t)) for n, t in
    (w.split("x") for w in os.environ.get("TOKENWIRE_BENCH_SERVICE_ECHO", "64x1024,256x512").split(","))
)  # fmt: skip


HEADER = ["path", "out tokens", "s", "tokens/s", "vs in-process", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
          "ITL p99 ms", "decode ITL p50 ms", "decode ITL p99 ms"]  # fmt: skip


@dataclass(slots=True)
class Run:
    name: str
    seconds: float
    tokens: int
    ttft_ms: list[float]
    itl_ms: list[float]
    decode_itl_ms: list[float]  # gaps once every stream had its first token

    def row(self, peer: Run | None = None) -> list[str]:
        tps = self.tokens / self.seconds
        ratio = f"{tps / (peer.tokens / peer.seconds):.3f}" if peer else "1"
        return [self.name, f"{self.tokens}", f"{self.seconds:.2f}", f"{tps:.1f}", ratio,
                f"{pct(self.ttft_ms, 50):.1f}", f"{pct(self.ttft_ms, 99):.1f}",
                f"{pct(self.itl_ms, 50):.2f}", f"{pct(self.itl_ms, 99):.2f}",
                f"{pct(self.decode_itl_ms, 50):.2f}", f"{pct(self.decode_itl_ms, 99):.2f}"]  # fmt: skip


def _tps(run: Run) -> float:
    return run.tokens / run.seconds


def _collect(name: str, start: float, end: float, lines: list[Timeline]) -> Run:
    # Until the last stream has its first token, gaps include steps that carry prompt
    # chunks; after it, every step is decoding only, and a gap is one step plus transport.
    all_started = max((t.start + t.ttft for t in lines if t.ttft is not None), default=start)
    return Run(name, end - start, sum(t.tokens for t in lines),
               [t.ttft * 1e3 for t in lines if t.ttft is not None],
               [g * 1e3 for t in lines for _, g in t.gaps],
               [g * 1e3 for t in lines for began, g in t.gaps if began >= all_started])  # fmt: skip


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(PROMPT)] for _ in range(REQUESTS)]


def _kv_tokens() -> int:
    return REQUESTS * (PROMPT + OUTPUT) + 1024


def _in_process_run(ex: Executor, prompts: list[list[int]]) -> Run:
    from worker.executor import Request, SamplingConfig

    sampling = SamplingConfig(temperature=0.0, min_tokens=OUTPUT)
    start = time.perf_counter()
    ids = ex.enqueue_requests([Request(input_token_ids=p, max_tokens=OUTPUT, streaming=True,
                                       sampling_config=sampling) for p in prompts])  # fmt: skip
    lines = {i: Timeline(start) for i in ids}
    pending = set(ids)
    while pending:
        for r in ex.await_responses(timeout=600):
            now = time.perf_counter()
            assert r.result is not None, r.error_msg
            lines[r.request_id].add(now, len(r.result.output_token_ids[0]))
            if r.result.is_final:
                pending.discard(r.request_id)
    return _collect("in process (Executor)", start, time.perf_counter(), list(lines.values()))


async def _stream_all(
    endpoint: str, prompts: list[list[int]], output: int, greedy: bool, curve: ClientCurve | None = None
) -> tuple[float, float, list[Timeline]]:
    from clients.async_client import AsyncClient

    async with AsyncClient([endpoint], curve=curve) as client:
        await client.generate([100, 101, 102], max_tokens=2, timeout=300)  # warm-up, and the worker is ready
        start = time.perf_counter()
        lines = [Timeline(start) for _ in prompts]
        extra = {"temperature": 0.0} if greedy else {}

        async def one(i: int) -> None:
            async for chunk in client.stream(prompts[i], max_tokens=output, min_tokens=output, **extra):
                lines[i].add(time.perf_counter(), len(chunk.token_ids))

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        return start, time.perf_counter(), lines


async def _http_stream_all(
    port: int, model: str, prompts: list[list[int]], output: int, greedy: bool, key: str | None = None
) -> tuple[float, float, list[Timeline]]:
    """Every prompt as one streamed /v1/completions request, concurrently (bench/http_stream.py),
    after one warm-up request. With `key`, each request sends it as its bearer token."""
    await stream_completion(port, model, [100, 101, 102], output, None, greedy=greedy, key=key)  # warm-up
    return await _http_timed(port, model, prompts, output, greedy, key)


async def _http_timed(
    port: int, model: str, prompts: list[list[int]], output: int, greedy: bool, key: str | None
) -> tuple[float, float, list[Timeline]]:
    start = time.perf_counter()
    lines = [Timeline(start) for _ in prompts]
    await asyncio.gather(*(stream_completion(port, model, p, output, t, greedy=greedy, key=key)
                           for p, t in zip(prompts, lines, strict=True)))  # fmt: skip
    return start, time.perf_counter(), lines


def _other_start(prompts: list[list[int]], shift: int = 1) -> list[list[int]]:
    """The prompts with a new first token: no block of theirs is in the prefix cache."""
    return [[100 + (p[0] + shift - 100) % 1000, *p[1:]] for p in prompts]


# The stacks of the CURVE comparison: plain, CURVE on, and plain again (the A/A control).
_OFF, _ON, _CONTROL = "CURVE off", "CURVE on", "control (CURVE off)"


def _start_stacks(model: Path, *worker_args: str) -> dict[str, Stack]:
    """The three stacks of the CURVE comparison, started at once: none loads its model
    (and takes its share of the accelerator) after another."""
    kinds = {_OFF: False, _ON: True, _CONTROL: False}
    with ThreadPoolExecutor(len(kinds)) as pool:
        starts = {name: pool.submit(Stack, model, *worker_args, curve=curve) for name, curve in kinds.items()}
    try:
        return {name: start.result() for name, start in starts.items()}
    except BaseException:
        for start in starts.values():
            if start.exception() is None:
                start.result().close()
        raise


@dataclass(slots=True)
class Sample:
    """One run of the CURVE comparison and the CPU seconds it took: the stack's gateway
    and worker processes (the engine's not included), and the client (this process)."""

    run: Run
    gateway_cpu_s: float
    worker_cpu_s: float
    client_cpu_s: float


def _sample(stack: Stack, prompts: list[list[int]]) -> Sample:
    """One run through the ZeroMQ client."""
    gateway, worker = stack.gateway_proc.pid, stack.workers[0].pid
    before = (cpu_seconds(gateway), cpu_seconds(worker), time.process_time())
    start, end, lines = asyncio.run(_stream_all(stack.gateway, prompts, OUTPUT, greedy=True, curve=stack.client_curve))
    after = (cpu_seconds(gateway), cpu_seconds(worker), time.process_time())
    return Sample(_collect("", start, end, lines), *(a - b for a, b in zip(after, before, strict=True)))


def orders(names: Sequence[str], n: int) -> list[tuple[str, ...]]:
    """The order of the stacks on each of n sets: all permutations in turn, so that over
    each full turn every stack runs in every place equally often and follows each
    other stack as often as it precedes it."""
    permutations = list(itertools.permutations(names))
    return [permutations[i % len(permutations)] for i in range(n)]


_Path = TypeVar("_Path")  # what a run goes through: a Stack, or one gateway of one (Front)


def curve_sets(
    stacks: dict[str, _Path],
    prompt_sets: list[list[list[int]]],
    budget_s: float,
    sample: Callable[[_Path, list[list[int]]], Sample],
) -> list[dict[str, Sample]]:
    """Each set once on each stack (`sample` runs it), back to back, in the orders above;
    no new set once `budget_s` has passed (a CPU takes half a minute a run), but at least two."""
    deadline = time.monotonic() + budget_s
    sets: list[dict[str, Sample]] = []
    for order, prompts in zip(orders(list(stacks), len(prompt_sets)), prompt_sets, strict=True):
        if len(sets) >= 2 and time.monotonic() >= deadline:
            break
        sets.append({name: sample(stacks[name], prompts) for name in order})
    return sets


def _total_ratio(sets: Sequence[dict[str, Sample]], a: str, b: str) -> float:
    """Stack a's tokens/s over stack b's, each the total tokens over the total time."""
    tps = {name: sum(s[name].run.tokens for s in sets) / sum(s[name].run.seconds for s in sets) for name in (a, b)}
    return tps[a] / tps[b]


def per_token_us(sets: Sequence[dict[str, Sample]], name: str, who: str) -> float:
    """CPU µs per streamed token of `who` ("gateway", "worker", "client") on stack `name`, over the sets."""
    return sum(getattr(s[name], f"{who}_cpu_s") for s in sets) * 1e6 / sum(s[name].run.tokens for s in sets)


@dataclass(frozen=True, slots=True)
class Versus:
    """Stack a against stack b over the sets."""

    total: float  # a's tokens/s over b's, each over all sets
    ci95: tuple[float, float]  # of `total`, by bootstrap: the sets drawn with replacement
    quartiles: tuple[float, float, float]  # of the per-set ratios a / b
    cpu_us_per_token: dict[str, tuple[float, float]]  # "gateway", "worker", "client": (a's, b's)
    gateway_cpu_ci95: tuple[float, float]  # of a's gateway CPU per token over b's, by the same bootstrap


def versus(sets: Sequence[dict[str, Sample]], a: str, b: str) -> Versus:
    rng = random.Random(0)
    draws = [rng.choices(sets, k=len(sets)) for _ in range(2000)]
    boot = sorted(_total_ratio(d, a, b) for d in draws)
    # NaN where b's gateway used no CPU time that /proc could tell (or there is no /proc).
    boot_cpu = sorted(per_token_us(d, a, "gateway") / (per_token_us(d, b, "gateway") or math.nan) for d in draws)
    ratios = [_tps(s[a].run) / _tps(s[b].run) for s in sets]
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    cpus = {who: (per_token_us(sets, a, who), per_token_us(sets, b, who)) for who in ("gateway", "worker", "client")}
    return Versus(_total_ratio(sets, a, b), (boot[49], boot[1949]), (q1, median, q3), cpus,
                  (boot_cpu[49], boot_cpu[1949]))  # fmt: skip


def _versus_text(sets: Sequence[dict[str, Sample]], a: str, b: str) -> str:
    v = versus(sets, a, b)
    cpu = ", ".join(f"{who} {x:.1f} vs {y:.1f}" for who, (x, y) in v.cpu_us_per_token.items())
    (gateway_a, gateway_b), (low, high) = v.cpu_us_per_token["gateway"], v.gateway_cpu_ci95
    return (
        f"{v.total:.3f} of the tokens/s in total (95 % CI {v.ci95[0]:.3f}-{v.ci95[1]:.3f}); per set median "
        f"{v.quartiles[1]:.3f}, IQR {v.quartiles[0]:.3f}-{v.quartiles[2]:.3f}; CPU µs/token {a} vs {b}: {cpu}; "
        f"gateway CPU/token {gateway_a / (gateway_b or math.nan):.3f} of {b}'s (95 % CI {low:.3f}-{high:.3f})"
    )


def compare(
    model: Path, prompt_sets: list[list[list[int]]], curve_prompt_sets: list[list[list[int]]]
) -> tuple[list[Run], list[Run], list[Run], list[Run], list[dict[str, Sample]]]:
    """The paths on each set of prompts in turn, in process first, so that a change
    in the machine's pace during the section weighs on all: every run of each path
    (in process, the stack, its HTTP front, the CURVE stack), one per set. One warm
    Executor here and one stack throughout, and a second stack with CURVE on (idle
    while the others run), and the control stack, which runs each set last. Then the
    CURVE comparison on its own sets (curve_sets)."""
    from worker.executor import Executor, ExecutorConfig, KvCacheConfig, Request

    config = ExecutorConfig(max_batch_size=max(64, REQUESTS), kv_cache_config=KvCacheConfig(max_tokens=_kv_tokens()))
    stacks = _start_stacks(model, "--kv-tokens", str(_kv_tokens()), "--max-batch-size", str(max(64, REQUESTS)))
    stack, curve_stack = stacks[_OFF], stacks[_ON]
    local, remote, http, curve = [], [], [], []
    try:
        with Executor.from_model(model, config) as ex:
            _ = ex.enqueue_request(Request(input_token_ids=[100, 101, 102], max_tokens=2))
            while not any(r.result and r.result.is_final for r in ex.await_responses(timeout=120)):
                pass
            settle_gc()  # as the worker and the gateway do once loaded
            for i, prompts in enumerate(prompt_sets):
                local.append(_in_process_run(ex, prompts))
                # CURVE off and on back to back, taking turns at going first, so that neither
                # always follows the other's work (or the HTTP run's) and an order effect evens out.
                for with_curve in (False, True) if i % 2 == 0 else (True, False):
                    if with_curve:
                        start, end, lines = asyncio.run(_stream_all(curve_stack.gateway, prompts, OUTPUT, greedy=True,
                                                                    curve=curve_stack.client_curve))  # fmt: skip
                        curve.append(_collect("gateway + worker (loopback), CURVE on", start, end, lines))
                    else:
                        start, end, lines = asyncio.run(_stream_all(stack.gateway, prompts, OUTPUT, greedy=True))
                        remote.append(_collect("gateway + worker (loopback)", start, end, lines))
                start, end, lines = asyncio.run(_http_stream_all(stack.http_port, model.name, _other_start(prompts),
                                                                 OUTPUT, greedy=True))  # fmt: skip
                http.append(_collect("HTTP+SSE front, gateway + worker (loopback)", start, end, lines))
                _sample(stacks[_CONTROL], prompts)  # as warm as the other two when the comparison starts
        sets = curve_sets(stacks, curve_prompt_sets, CURVE_BUDGET_S, _sample)
    finally:
        for s in stacks.values():
            s.close()
    return local, remote, http, curve, sets


# The gateways of the API key comparison: keys off, keys and limits on, keys off again (the A/A control).
_KEYS_OFF, _KEYS_ON, _KEYS_CONTROL = "keys off", "keys + limits on", "control (keys off)"
BENCH_KEY = "tw-bench-key"


def keys_sets(model: Path, prompt_sets: list[list[list[int]]]) -> list[dict[str, Sample]]:
    """The HTTP front with API keys and limits on against off (and off against off): three
    gateways in front of one worker, as warm as each other (one run each first)."""
    import redis

    from protocol import Keys
    from protocol.api_keys import ApiKeyRecord, KeyLimits, key_hash

    kv_tokens = REQUESTS * (PROMPT + KEYS_OUTPUT) + 1024
    stack = Stack(model, "--kv-tokens", str(kv_tokens), "--max-batch-size", str(max(64, REQUESTS)))
    try:
        # Limits far above the load: every request is admitted, counted and ended through them.
        limits = KeyLimits(max_concurrent=10**6, requests_per_minute=10**9, tokens_per_minute=10**12)
        record = ApiKeyRecord(name="bench", limits=limits)
        with redis.Redis.from_url(stack.redis) as r:
            r.hset(Keys().api_keys(), key_hash(BENCH_KEY), record.model_dump_json())
        fronts = {_KEYS_OFF: Front(stack.gateway, stack.http_port, stack.gateway_proc),
                  _KEYS_ON: stack.add_gateway("--api-keys-redis"), _KEYS_CONTROL: stack.add_gateway()}  # fmt: skip
        shift = {front.http_port: i for i, front in enumerate(fronts.values())}
        worker = stack.workers[0].pid

        def sample(front: Front, prompts: list[list[int]]) -> Sample:
            # No warm-up request (the first run on each gateway is one): the CPU time is the run's alone.
            own = _other_start(prompts, shift[front.http_port])
            before = (cpu_seconds(front.proc.pid), cpu_seconds(worker), time.process_time())
            start, end, lines = asyncio.run(_http_timed(front.http_port, model.name, own, KEYS_OUTPUT, True, BENCH_KEY))
            after = (cpu_seconds(front.proc.pid), cpu_seconds(worker), time.process_time())
            return Sample(_collect("", start, end, lines), *(x - y for x, y in zip(after, before, strict=True)))

        for front in fronts.values():
            sample(front, prompt_sets[0])
        return curve_sets(fronts, prompt_sets[1:], KEYS_BUDGET_S, sample)
    finally:
        stack.close()


def _stack_text(sets: Sequence[dict[str, Sample]], name: str) -> str:
    """One gateway's figures over the sets: its tokens/s, and CPU µs per streamed token."""
    tps = sum(s[name].run.tokens for s in sets) / sum(s[name].run.seconds for s in sets)
    cpu = ", ".join(f"{who} {per_token_us(sets, name, who):.2f}" for who in ("gateway", "worker", "client"))
    return f"{tps:.1f} tokens/s; CPU µs per streamed token: {cpu}"


def _echo_stack(model: Path, curve: bool = False, workers: int = 1, gateways: int = 1) -> Stack:
    from worker.executor.types import KvCacheConfig

    most = max(n for n, _ in ECHO_WORKLOADS)
    # Whole blocks per stream: 256 streams of 3 + 512 tokens sized by tokens alone left 12
    # of them waiting for the others to end (a TTFT p99 of the whole run, 0.8-5 s).
    block = KvCacheConfig().tokens_per_block
    kv_tokens = most * -(-(3 + max(t for _, t in ECHO_WORKLOADS)) // block) * block + 1024
    return Stack(model, "--backend", "echo", "--max-batch-size", str(most), "--max-num-tokens", "65536",
                  "--kv-tokens", str(kv_tokens), curve=curve, workers=workers, gateways=gateways,
                  gateway_args=["--max-inflight", "65536"])  # fmt: skip


def echo_transport(model: Path) -> list[Run]:
    runs = []
    stack = _echo_stack(model)
    gateway_pid = stack.gateway_proc.pid
    try:
        # Up and warm (the gateway has loaded the worker's tokenizer) before any CPU time counts.
        asyncio.run(_stream_all(stack.gateway, [[100, 200, 300]], 2, greedy=False))
        for streams, tokens in ECHO_WORKLOADS:
            prompts = [[100 + i, 200 + i, 300 + i] for i in range(streams)]
            gateway_cpu, client_cpu = cpu_seconds(gateway_pid), time.process_time()
            start, end, lines = asyncio.run(_stream_all(stack.gateway, prompts, tokens, greedy=False))
            gateway_us = (cpu_seconds(gateway_pid) - gateway_cpu) * 1e6 / (streams * tokens)
            client_us = (time.process_time() - client_cpu) * 1e6 / (streams * tokens)
            name = (f"TRANSPORT TEST echo worker, {streams} streams x {tokens} "
                    f"(CPU µs/token: gateway {gateway_us:.1f}, client {client_us:.1f})")  # fmt: skip
            runs.append(_collect(name, start, end, lines))
        streams, tokens = ECHO_WORKLOADS[0]
        prompts = [[100 + i, 200 + i, 300 + i] for i in range(streams)]
        gateway_cpu, client_cpu = cpu_seconds(gateway_pid), time.process_time()
        start, end, lines = asyncio.run(_http_stream_all(stack.http_port, model.name, prompts, tokens, greedy=False))
        gateway_us = (cpu_seconds(gateway_pid) - gateway_cpu) * 1e6 / (streams * tokens)
        client_us = (time.process_time() - client_cpu) * 1e6 / (streams * tokens)
        name = (f"TRANSPORT TEST echo worker, HTTP+SSE, {streams} streams x {tokens} "
                f"(CPU µs/token: gateway {gateway_us:.1f}, client {client_us:.1f})")  # fmt: skip
        runs.append(_collect(name, start, end, lines))
        if ECHO_CLIENTS > 1:  # what one gateway carries when the clients are not the limit
            # Many streams, then many short requests (at most 1,024 in flight per client: the gateway's limit;
            # the whole gateway's is raised for them).
            for streams, tokens in ((max(n for n, _ in ECHO_WORKLOADS), 512), (1024 * ECHO_CLIENTS, 16)):
                runs.append(_echo_spread(stack, streams, tokens))
    finally:
        stack.close()
    if ECHO_CLIENTS > 1 and ECHO_WORKERS > 1:  # the gateway's own ceiling: more echo workers than one gateway needs
        stack = _echo_stack(model, workers=ECHO_WORKERS, gateways=ECHO_GATEWAYS)
        try:
            runs += [_echo_spread(stack, streams, tokens)
                     for streams, tokens in ((max(n for n, _ in ECHO_WORKLOADS), 512), (1024 * ECHO_CLIENTS, 16))]
        finally:
            stack.close()
    runs.append(_echo_with_curve(model))
    return runs


def _echo_spread(stack: Stack, streams: int, tokens: int) -> Run:
    """The echo workload from ECHO_CLIENTS client processes, all sent at once."""
    from bench.serving_bench import client_process

    prompts = [[100 + i % 1000, 200, 300] for i in range(streams)]
    before = stack.cpu_seconds()
    with ProcessPoolExecutor(ECHO_CLIENTS, mp_context=get_context("spawn")) as pool:
        start_at = time.perf_counter() + 5.0  # every client process up and connected by then
        shares = [pool.submit(client_process, stack.gateways[k % len(stack.gateways)], prompts[k::ECHO_CLIENTS],
                              [0.0] * len(prompts[k::ECHO_CLIENTS]), tokens, start_at)
                  for k in range(ECHO_CLIENTS)]  # fmt: skip
        results = [share.result() for share in shares]
    after = stack.cpu_seconds()
    lines = [line for got, _ in results for line in got]
    start, end = min(t.start for t in lines), max(t.last or t.start for t in lines)
    us = {p: (after[p] - before[p]) * 1e6 / (streams * tokens) for p in after}
    clients_us = sum(cpu for _, cpu in results) * 1e6 / (streams * tokens)
    workers = f"{len(stack.workers)} echo workers" if len(stack.workers) > 1 else "echo worker"
    if len(stack.gateways) > 1:
        workers += f", {len(stack.gateways)} gateway processes"
    name = (f"TRANSPORT TEST {workers}, {ECHO_CLIENTS} client processes, {streams} streams x {tokens}: "
            f"{streams / (end - start):,.0f} req/s (CPU µs/token: gateway {us['gateway']:.1f}, worker "
            f"{us['worker']:.1f}, engine {us['engine']:.1f}, clients {clients_us:.1f})")  # fmt: skip
    return _collect(name, start, end, lines)


def _echo_with_curve(model: Path) -> Run:
    """The first echo workload with CURVE on between client, gateway and worker: where the
    transport, not a model, bounds the rate, this is CURVE's cost (compare the plain row)."""
    stack = _echo_stack(model, curve=True)
    try:
        asyncio.run(_stream_all(stack.gateway, [[100, 200, 300]], 2, greedy=False, curve=stack.client_curve))
        streams, tokens = ECHO_WORKLOADS[0]
        prompts = [[100 + i, 200 + i, 300 + i] for i in range(streams)]
        gateway_cpu, client_cpu = cpu_seconds(stack.gateway_proc.pid), time.process_time()
        start, end, lines = asyncio.run(_stream_all(stack.gateway, prompts, tokens, greedy=False,
                                                    curve=stack.client_curve))  # fmt: skip
        gateway_us = (cpu_seconds(stack.gateway_proc.pid) - gateway_cpu) * 1e6 / (streams * tokens)
        client_us = (time.process_time() - client_cpu) * 1e6 / (streams * tokens)
        name = (f"TRANSPORT TEST echo worker, CURVE on, {streams} streams x {tokens} "
                f"(CPU µs/token: gateway {gateway_us:.1f}, client {client_us:.1f})")  # fmt: skip
        return _collect(name, start, end, lines)
    finally:
        stack.close()


def table() -> tuple[list[str], list[list[str]]]:
    model = default_model()
    vocab = vocab_size(model)
    # New prompts for each repeat (the same sets for both paths): a repeated prompt
    # would be served from the prefix cache.
    prompt_sets = [_prompts(vocab, seed) for seed in range(REPEATS)]
    curve_prompt_sets = [_prompts(vocab, REPEATS + i) for i in range(CURVE_PAIRS)]
    *runs, sets = compare(model, prompt_sets, curve_prompt_sets)
    keys = keys_sets(model, [_prompts(vocab, REPEATS + CURVE_PAIRS + i) for i in range(KEYS_PAIRS + 1)])
    local, remote, http, curve = (min(r, key=lambda run: run.seconds) for r in runs)  # the fastest of each path
    rows = [local.row(), remote.row(local), curve.row(local), http.row(local)]
    rows.append([f"(CURVE on vs off, {len(sets)} sets, orders permuted: {_versus_text(sets, _ON, _OFF)}; goal >= 0.97)",
                 *[""] * 10])  # fmt: skip
    rows.append([f"(A/A control, CURVE off on two stacks, the same sets: {_versus_text(sets, _CONTROL, _OFF)})",
                 *[""] * 10])  # fmt: skip
    rows.append([f"(API keys + limits on vs off, HTTP front, {len(keys)} sets, orders permuted: "
                 f"{_versus_text(keys, _KEYS_ON, _KEYS_OFF)}; goal >= 0.98)", *[""] * 10])  # fmt: skip
    control = _versus_text(keys, _KEYS_CONTROL, _KEYS_OFF)
    rows.append([f"(A/A control, keys off on two gateways, the same sets: {control})", *[""] * 10])
    rows += [[f"(gateway {name}: {_stack_text(keys, name)})", *[""] * 10]
             for name in (_KEYS_OFF, _KEYS_ON, _KEYS_CONTROL)]  # fmt: skip
    added = pct(http.decode_itl_ms, 99) - pct(remote.decode_itl_ms, 99)
    rows.append([f"(HTTP vs ZeroMQ client: {http.tokens / http.seconds / (remote.tokens / remote.seconds):.3f} of "
                 f"its tokens/s, {added:+.2f} ms decode ITL p99)", *[""] * 10])  # fmt: skip
    rows.append([f"(workload: {REQUESTS} streams x {PROMPT} prompt / {OUTPUT} output tokens, default model)",
                 *[""] * 10])  # fmt: skip
    rows += [r.row() for r in echo_transport(model)]
    return HEADER, rows


def keys_table(model: Path) -> tuple[list[str], list[list[str]]]:
    """Part (c) alone, on any checkpoint: what API keys and limits cost at that model's load."""
    vocab = vocab_size(model)
    keys = keys_sets(model, [_prompts(vocab, i) for i in range(KEYS_PAIRS + 1)])
    return ["API keys + limits on the HTTP front", "figure"], [
        ["keys + limits on vs off", f"{len(keys)} sets, orders permuted: {_versus_text(keys, _KEYS_ON, _KEYS_OFF)}; "
         "goal >= 0.98"],
        ["A/A control, keys off vs off", _versus_text(keys, _KEYS_CONTROL, _KEYS_OFF)],
        *([f"gateway: {name}", _stack_text(keys, name)] for name in (_KEYS_OFF, _KEYS_ON, _KEYS_CONTROL)),
        ["workload", f"{REQUESTS} streams x {PROMPT} prompt / {KEYS_OUTPUT} output tokens, {model.name}, "
         "three gateways in front of one worker"],
    ]  # fmt: skip


def main() -> None:

    from bench.run import format_table

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys-only", type=Path, default=None, metavar="CHECKPOINT",
                   help="only part (c), API keys and limits, on this checkpoint (a larger model on a GPU)")
    p.add_argument("--echo-only", type=Path, default=None, metavar="CHECKPOINT",
                   help="only the echo transport rows, on this checkpoint's config and tokenizer")
    args = p.parse_args()
    if args.echo_only:
        print(format_table(HEADER, [r.row() for r in echo_transport(args.echo_only)]))
        return
    print(format_table(*(keys_table(args.keys_only) if args.keys_only else table())))


if __name__ == "__main__":
    main()
