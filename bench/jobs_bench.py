"""The job queue: jobs/s end to end, and what the queue itself costs per job.

Every run starts a private redis-server, one worker, one gateway and one job
consumer (`tokenwire jobs consume`) as child processes on loopback, and puts N
short jobs through them (`JobQueue.submit_many`, then `results`), timed from
the first submit to the last result. Its peer, in the same run and on the same
processes, is the same N requests sent straight to the gateway with the client
library, as many in flight at once as the consumer allows itself (the worker's
batch slots).

(a) The default model (SmolLM2-135M-Instruct) on this machine's backend: short
text prompts, O output tokens. (b) TRANSPORT TEST: the worker's `--backend echo`
(no model runs), so the difference between the two rows is the queue's own
cost: Redis round trips, the consumer hop, results stored and polled.

Sizes: TOKENWIRE_BENCH_JOBS (1000 jobs a run), TOKENWIRE_BENCH_JOBS_OUTPUT (2 output
tokens a job). On two CPU cores the default model's rows take about three minutes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import SkipSection, free_port
from ops.process import stop_children

TITLE = "jobs: N short jobs through Redis + consumer vs the same requests sent straight to the gateway"
JOBS = int(os.environ.get("TOKENWIRE_BENCH_JOBS", "1000"))
OUTPUT = int(os.environ.get("TOKENWIRE_BENCH_JOBS_OUTPUT", "2"))
SLOTS = 64  # the worker's --max-batch-size: the consumer keeps at most this many jobs in flight
REPO = Path(__file__).resolve().parents[1]


class _Processes:
    """redis-server, worker, gateway and consumer as child processes; logs in a temp dir."""

    def __init__(self, model: str, *worker_args: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SkipSection("redis-server is not on PATH")
        self.dir = Path(tempfile.mkdtemp(prefix="tokenwire-jobs-bench-"))
        port = free_port()
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        self.gateway = f"tcp://127.0.0.1:{free_port()}"
        worker = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self._start("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(self.dir)])
        tw = [sys.executable, "-m"]
        self._start("worker", [*tw, "worker.service", "--model", model, "--bind", worker, "--redis", self.redis_url,
                               "--max-batch-size", str(SLOTS), *worker_args])  # fmt: skip
        self._start("gateway", [*tw, "gateway", "--bind", self.gateway, "--redis", self.redis_url])
        self._start("consumer", [*tw, "clients.cli", "jobs", "consume", "--gateway", self.gateway,
                                 "--redis", self.redis_url, "--max-in-flight", str(SLOTS)])  # fmt: skip
        self._wait_ready()

    def _start(self, name: str, args: list[str]) -> None:
        log = (self.dir / f"{name}.log").open("wb")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.procs.append(subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))

    def _wait_ready(self, timeout: float = 300.0) -> None:
        """Until the gateway is connected to the worker and the worker's load is in Redis."""
        import redis

        from protocol import Keys

        r: Any = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + timeout
        while True:
            for name, p in zip(("redis", "worker", "gateway", "consumer"), self.procs, strict=True):
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited: {(self.dir / f'{name}.log').read_text()[-2000:]}")
            try:
                ready = "ready: [" in (self.dir / "gateway.log").read_text() and any(
                    r.get(Keys().heartbeat(w.decode())) for w in r.zrange(Keys().workers(), 0, -1)
                )
            except redis.ConnectionError:
                ready = False
            if ready:
                r.close()
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the service did not come up within {timeout} s; logs in {self.dir}")
            time.sleep(0.1)

    def close(self) -> None:
        stop_children(self.procs, timeout_s=15)
        shutil.rmtree(self.dir, ignore_errors=True)


def _prompts(tag: str) -> list[str]:
    """A few tokens each; a tag per run, so neither run reuses the other's KV blocks."""
    return [f"{tag} {i}?" for i in range(JOBS)]


def _through_queue(procs: _Processes, prompts: list[str]) -> float:
    from clients.jobs import JobQueue

    with JobQueue(procs.redis_url) as queue:
        start = time.perf_counter()
        ids = queue.submit_many([{"prompt": p, "max_tokens": OUTPUT, "min_tokens": OUTPUT} for p in prompts])
        results = list(queue.results(ids, timeout=1800))
        seconds = time.perf_counter() - start
    bad = [r for r in results if r.status != "done"]
    if bad:
        raise RuntimeError(f"{len(bad)} jobs did not end done, e.g. {bad[0]}")
    return seconds


def _straight(procs: _Processes, prompts: list[str]) -> float:
    """The same requests from SLOTS threads, each sending its share one at a time."""
    from clients.client import Client

    with Client([procs.gateway]) as client:
        client.generate("warm up", max_tokens=1, timeout=300)
        start = time.perf_counter()

        def share(k: int) -> None:
            for p in prompts[k::SLOTS]:
                client.generate(p, max_tokens=OUTPUT, min_tokens=OUTPUT, timeout=1800)

        threads = [threading.Thread(target=share, args=(k,)) for k in range(SLOTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - start


def _latency(procs: _Processes, n: int) -> tuple[float, float]:
    """Median milliseconds for one job alone, through the queue and straight."""
    from clients.client import Client
    from clients.jobs import JobQueue

    queued, direct = [], []
    with JobQueue(procs.redis_url) as queue, Client([procs.gateway]) as client:
        for i in range(n):
            t = time.perf_counter()
            queue.result(queue.submit(f"ping {i}", max_tokens=1), timeout=60)
            queued.append(time.perf_counter() - t)
            t = time.perf_counter()
            client.generate(f"ping {i}", max_tokens=1, timeout=60)
            direct.append(time.perf_counter() - t)
    return 1000 * sorted(queued)[n // 2], 1000 * sorted(direct)[n // 2]


def _rows(label: str, samples: int, model: str, *worker_args: str) -> list[list[str]]:
    procs = _Processes(model, *worker_args)
    try:
        direct = _straight(procs, _prompts("Hi"))
        queued = _through_queue(procs, _prompts("Yo"))
        lat_q, lat_d = _latency(procs, samples)
    finally:
        procs.close()
    cost_ms = 1000 * (queued - direct) / JOBS
    return [
        [label, "straight to the gateway", f"{JOBS / direct:.1f}", "1", "-", f"{lat_d:.1f}"],
        [label, "job queue", f"{JOBS / queued:.1f}", f"{direct / queued:.3f}", f"{cost_ms:+.3f}", f"{lat_q:.1f}"],
    ]


def table() -> tuple[list[str], list[list[str]]]:
    try:
        import redis  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        raise SkipSection(f"needs {e.name}") from None
    header = ["worker", f"path ({JOBS} jobs, {OUTPUT} tokens)", "jobs/s", "vs straight", "ms/job added",
              "1 job alone, p50 ms"]  # fmt: skip
    rows = _rows("SmolLM2-135M", 10, "SmolLM2-135M-Instruct")
    rows += _rows("echo (transport test)", 100, "SmolLM2-135M-Instruct", "--backend", "echo")
    return header, rows
