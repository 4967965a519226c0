"""Routing multi-turn chats over two workers: least-loaded against prefix-aware, in one run.

One private redis-server, two workers of the default model (one compute thread
each) and two gateways on them, one routing by load alone (`--router least-loaded`),
the other by the prompt blocks each worker's KV cache holds (`--router prefix`).
The same workload goes through each gateway in turn, least-loaded first, with prompts
of its own (so neither run finds the other's conversations cached):
TOKENWIRE_BENCH_FLEET_CONVERSATIONS chats (default 16) start at a fixed rate
(_RATE per second, default 0.5); each has its own system prompt of _SYSTEM tokens
(default 400) and _TURNS turns (default 4), a turn adding _USER user tokens (32) to
the conversation so far and streaming _OUTPUT tokens (16, greedy, EOS banned) back;
the user pauses 1-4 s between turns.

Per router: the share of follow-up turns served by the worker that served the turn
before (the one holding the conversation's blocks; goal >= 90 % for prefix
routing), the prefix-cache hit rate (full prompt blocks the chosen worker's index
held when the gateway routed the turn, from the gateway's /metrics) against the
oracle (blocks an earlier turn of the same conversation computed), TTFT p50 / p99
of follow-up turns and of first turns (measured at the client), and output
tokens/s over the run. The last row is the follow-up TTFT p50 ratio (goal >= 2).
All processes share this machine's cores.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass, field

from bench import default_model, vocab_size
from bench.fleet_stack import Fleet

TITLE = "fleet: least-loaded vs prefix-aware routing of multi-turn chats, 2 workers, default model"
CONVERSATIONS = int(os.environ.get("TOKENWIRE_BENCH_FLEET_CONVERSATIONS", "16"))
TURNS = int(os.environ.get("TOKENWIRE_BENCH_FLEET_TURNS", "4"))
SYSTEM = int(os.environ.get("TOKENWIRE_BENCH_FLEET_SYSTEM", "400"))
USER = int(os.environ.get("TOKENWIRE_BENCH_FLEET_USER", "32"))
OUTPUT = int(os.environ.get("TOKENWIRE_BENCH_FLEET_OUTPUT", "16"))
RATE = float(os.environ.get("TOKENWIRE_BENCH_FLEET_RATE", "0.5"))
PAUSE_S = (1.0, 4.0)
ROUTERS = ("least-loaded", "prefix")


@dataclass(slots=True)
class Turn:
    conversation: int
    index: int  # 0: the first turn
    request_id: str
    prompt_tokens: int
    ttft_s: float
    known_tokens: int  # of its prompt, computed by earlier turns of its conversation (the oracle's hit)
    worker: str = ""


@dataclass(slots=True)
class Result:
    router: str
    seconds: float
    tokens: int
    turns: list[Turn] = field(default_factory=list)
    prompt_blocks: float = 0.0  # the gateway's counters: full prompt blocks routed
    matched_blocks: float = 0.0  # and those the chosen worker's index held


async def _chats(endpoint: str, vocab: int, seed: int) -> tuple[float, int, list[Turn]]:
    from clients.async_client import AsyncClient

    rng = random.Random(seed)
    turns: list[Turn] = []
    tokens = 0
    async with AsyncClient([endpoint]) as client:
        for w in range(2):  # warm-up: each worker has run a step (least-loaded spreads them)
            await client.generate([100 + w, 101, 102], max_tokens=2, timeout=300)

        async def chat(c: int) -> None:
            nonlocal tokens
            await asyncio.sleep(c / RATE)
            conversation = [rng.randrange(3, vocab) for _ in range(SYSTEM)]
            known = 0
            for t in range(TURNS):
                conversation += [rng.randrange(3, vocab) for _ in range(USER)]
                sent = time.perf_counter()
                request = client.stream(list(conversation), max_tokens=OUTPUT, min_tokens=OUTPUT, temperature=0.0)
                first: float | None = None
                out: list[int] = []
                async for chunk in request:
                    if first is None and chunk.token_ids:
                        first = time.perf_counter()
                    out += chunk.token_ids
                turns.append(Turn(c, t, request.request_id, len(conversation), (first or sent) - sent, known))
                tokens += len(out)
                # What this turn computed: its prompt and every output token but the last.
                known = len(conversation) + len(out) - 1
                conversation += out
                await asyncio.sleep(rng.uniform(*PAUSE_S))

        start = time.perf_counter()
        await asyncio.gather(*(chat(c) for c in range(CONVERSATIONS)))
        return time.perf_counter() - start, tokens, turns


def _counters(fleet: Fleet, router: str) -> tuple[float, float]:
    """(prompt blocks, matched blocks) the gateway routed, summed over workers."""
    from prometheus_client.parser import text_string_to_metric_families

    names = ("tokenwire_gateway_prefix_prompt_blocks_total", "tokenwire_gateway_prefix_matched_blocks_total")
    sums = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(fleet.metrics(router)):
        for s in family.samples:
            if s.name in sums:
                sums[s.name] += s.value
    return sums[names[0]], sums[names[1]]


def _run(fleet: Fleet, router: str, vocab: int, seed: int) -> Result:
    import redis

    import protocol

    before = _counters(fleet, router)
    seconds, tokens, turns = asyncio.run(_chats(fleet.gateways[router][0], vocab, seed))
    after = _counters(fleet, router)
    keys = protocol.Keys()
    db = redis.Redis.from_url(fleet.redis, decode_responses=True)
    try:
        for turn in turns:
            deadline = time.monotonic() + 10
            while not (worker := db.hget(keys.request_stats(turn.request_id), "worker")):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no request stats for {turn.request_id}")
                time.sleep(0.05)
            turn.worker = str(worker)
    finally:
        db.close()
    return Result(router, seconds, tokens, turns, after[0] - before[0], after[1] - before[1])


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def _row(r: Result, block: int) -> list[str]:
    by_turn = {(t.conversation, t.index): t for t in r.turns}
    follow = [t for t in r.turns if t.index]
    home = sum(t.worker == by_turn[(t.conversation, t.index - 1)].worker for t in follow)
    oracle = sum(min(t.known_tokens // block, (t.prompt_tokens - 1) // block) for t in r.turns)
    total = sum((t.prompt_tokens - 1) // block for t in r.turns)
    ttft = [t.ttft_s * 1e3 for t in follow]
    first = [t.ttft_s * 1e3 for t in r.turns if not t.index]
    return [r.router, f"{100 * home / len(follow):.0f} %",
            f"{r.matched_blocks / max(r.prompt_blocks, 1):.2f} / {oracle / max(total, 1):.2f}",
            f"{_pct(ttft, 50):.0f}", f"{_pct(ttft, 99):.0f}", f"{_pct(first, 50):.0f}", f"{_pct(first, 99):.0f}",
            f"{r.tokens / r.seconds:.1f}", f"{r.seconds:.0f}"]  # fmt: skip


def table() -> tuple[list[str], list[list[str]]]:
    from worker.executor.types import KvCacheConfig

    model = default_model()
    vocab = vocab_size(model)
    fleet = Fleet(model, ROUTERS)
    try:
        fleet.wait_ready()
        results = [_run(fleet, router, vocab, seed) for seed, router in enumerate(ROUTERS)]
    finally:
        fleet.close()
    block = KvCacheConfig().tokens_per_block
    header = ["router", "follow-ups on holder", "hit rate / oracle", "follow-up TTFT p50 ms", "p99 ms",
              "first-turn TTFT p50 ms", "p99 ms", "out tokens/s", "s"]  # fmt: skip
    rows = [_row(r, block) for r in results]
    p50 = [_pct([t.ttft_s for t in r.turns if t.index], 50) for r in results]
    rows.append([f"(follow-up TTFT p50, least-loaded / prefix: {p50[0] / p50[1]:.2f}x; goal >= 2; goal on holder "
                 f">= 90 %)", *[""] * 8])  # fmt: skip
    rows.append([f"(workload: {CONVERSATIONS} chats x {TURNS} turns, {SYSTEM}-token system prompt, +{USER} user "
                 f"/ {OUTPUT} output tokens a turn, {RATE:g} chats/s, pauses {PAUSE_S[0]:g}-{PAUSE_S[1]:g} s)",
                 *[""] * 8])  # fmt: skip
    return header, rows
