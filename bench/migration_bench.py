"""Request migration's cost: how long a stream stalls when its worker dies mid-stream.

Two workers of the default model (one compute thread each) and one gateway, heartbeats
every second and a peer lost after three silent intervals (the defaults). STREAMS
greedy streams of TOKENS tokens start together; once each has streamed WARM tokens,
worker0 is stopped, one way per run, each run on a fresh fleet:

- kill -9: the process dies and its connections close; the gateway sees that at once;
- SIGSTOP: the process hangs with its connections open, as a hung host would; only the
  heartbeat bound shows it.

Per run: the streams migrated (the gateway's log), the stall each of them saw (its
longest gap between chunks after the fault, less its median gap before), p50 and max;
when the gateway declared the worker lost, after the fault; and the continuation's
prefill on the survivor (the TTFT of a fresh prompt as long as a stream's prompt plus
the tokens it had received). Goal: stall <= 2 heartbeat intervals + that prefill. (That
a migrated stream's tokens are an undisturbed run's is for the tests to show:
tests/integration/test_migration.py.)
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime

from bench import default_model, vocab_size
from bench.fleet_stack import Fleet

TITLE = "migration: the stall of a stream whose worker dies, 2 workers, default model"
STREAMS = int(os.environ.get("TOKENWIRE_BENCH_MIGRATION_STREAMS", "8"))
TOKENS = int(os.environ.get("TOKENWIRE_BENCH_MIGRATION_TOKENS", "160"))
WARM = 24  # tokens every stream has received before the fault
PROMPT = 64
HEARTBEAT_S = 1.0


@dataclass(slots=True)
class _Stream:
    request_id: str = ""
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (unix time, tokens so far)
    tokens: list[int] = field(default_factory=list)


def _follow(future: object, stream: _Stream) -> None:
    for chunk in future:  # type: ignore[attr-defined]
        stream.tokens += chunk.token_ids
        stream.arrivals.append((time.time(), len(stream.tokens)))


def _stall(stream: _Stream, fault_at: float) -> float:
    """Its longest gap after the fault, less its median gap before."""
    times = [t for t, _ in stream.arrivals]
    before = [b - a for a, b in itertools.pairwise(times) if b < fault_at]
    after = [b - a for a, b in itertools.pairwise(times) if b >= fault_at]
    return max(after, default=0.0) - statistics.median(before or [0.0])


def _logged_at(log: str, text: str) -> float | None:
    """The unix time of the first gateway log line holding `text` (its local timestamp)."""
    for line in log.splitlines():
        if text in line:
            return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def _run(how: str, prompts: list[list[int]], vocab: int) -> list[str]:
    from clients.client import Client

    fleet = Fleet(default_model(), ["prefix"])
    try:
        fleet.wait_ready()
        endpoint = fleet.gateways["prefix"][0]
        with Client([endpoint]) as client:
            for w in range(2):  # warm-up: each worker has run a step
                client.generate([100 + w, 101, 102], max_tokens=2, timeout=300)
            streams = [_Stream() for _ in prompts]
            futures = [client.stream(p, max_tokens=TOKENS, ignore_eos=True, temperature=0.0) for p in prompts]
            for f, s in zip(futures, streams, strict=True):
                s.request_id = f.request_id
            threads = [threading.Thread(target=_follow, args=(f, s), daemon=True)
                       for f, s in zip(futures, streams, strict=True)]  # fmt: skip
            for t in threads:
                t.start()
            while any(len(s.tokens) < WARM for s in streams):
                time.sleep(0.005)
            victim = fleet.workers[0]
            received = statistics.median([len(s.tokens) for s in streams])
            fault_at = time.time()
            victim.send_signal(signal.SIGKILL if how == "kill -9" else signal.SIGSTOP)
            for t in threads:
                t.join(timeout=600)
            log = fleet.log.read_text(errors="replace")
            migrated = [s for s in streams if f"request {s.request_id} continued" in log]
            lost_at = _logged_at(log, "worker worker0 lost")
            prefill = []
            rng = random.Random(7)
            for _ in range(3):  # fresh prompts as long as a continuation's: its prefill, on the survivor
                start = time.perf_counter()
                fresh = [rng.randrange(3, vocab) for _ in range(PROMPT + int(received))]
                client.generate(fresh, max_tokens=1, ignore_eos=True, timeout=300)
                prefill.append(time.perf_counter() - start)
        if how == "SIGSTOP":
            victim.send_signal(signal.SIGKILL)
        stalls = sorted(_stall(s, fault_at) for s in migrated) or [float("nan")]
        row = [how, f"{len(migrated)} / {len(streams)}",
               "-" if lost_at is None else f"{lost_at - fault_at:.2f}",
               f"{statistics.median(stalls):.2f}", f"{stalls[-1]:.2f}", f"{statistics.median(prefill) * 1e3:.0f}",
               f"{2 * HEARTBEAT_S + statistics.median(prefill):.2f}"]  # fmt: skip
        return row
    finally:
        fleet.close()


def table() -> tuple[list[str], list[list[str]]]:
    model = default_model()
    vocab = vocab_size(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT)] for _ in range(STREAMS)]
    rows = [_run(how, prompts, vocab) for how in ("kill -9", "SIGSTOP")]
    header = ["fault", "streams migrated", "declared lost after s", "stall p50 s", "stall max s",
              "continuation prefill ms", "goal: stall <= s"]  # fmt: skip
    note = (f"(workload: {STREAMS} greedy streams x {TOKENS} tokens, {PROMPT}-token prompts, fault after {WARM} "
            f"tokens each; heartbeats every {HEARTBEAT_S:g} s, lost after 3 silent)")
    return header, [*rows, [note, *[""] * 6]]
