"""Real worker and gateway processes for the service tests.

Each process runs `python -m worker.service` / `python -m gateway` from this
checkout on a free loopback port, logs to a file under the test's tmp dir, and
is killed at teardown. Heartbeats are short (HEARTBEAT_S) so failures are
noticed in about a second.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

import protocol
from ops.process import stop_children

HEARTBEAT_S = 0.25
MISSED = 8  # a peer is declared gone after HEARTBEAT_S * MISSED = 2 s: tolerant of a loaded 2-core CI machine
# What the tests' clients are given for the test gateways: their heartbeat interval, and MISSED
# silent intervals before one is given up (the client's default, 3, is 0.75 s here: a loaded 2-core
# CI host has paused a gateway for 0.9 s, and the request then failed "gateway lost").
CLIENT_OPTIONS: dict[str, Any] = {"heartbeat_interval_s": HEARTBEAT_S, "missed_heartbeats": MISSED}
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has: it waits to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def long_context_checkpoint(checkpoint: Path, directory: Path, max_positions: int = 8192) -> Path:
    """The same tiny checkpoint with a longer context, for requests that must run
    for seconds (cancel and kill tests): the weights do not depend on it."""
    directory.mkdir(parents=True, exist_ok=True)
    for item in checkpoint.iterdir():
        target = directory / item.name
        if not target.exists():
            target.symlink_to(item)
    config = json.loads((checkpoint / "config.json").read_text())
    config["max_position_embeddings"] = max_positions
    (directory / "config.json").unlink()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


class Proc:
    def __init__(self, name: str, module: str, args: list[str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        # This checkout first; what the caller's path adds (packages installed beside the venv) after it.
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill9(self) -> None:
        if self.alive:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> int | None:
        stop_children([self.process])
        self._log.close()
        return self.process.returncode

    def wait_log(self, text: str, count: int = 1, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.log().count(text) >= count:
                return
            if not self.alive:
                raise AssertionError(f"{self.name} exited ({self.process.returncode}):\n{self.log()[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(
            f"{self.name}: {text!r} x{count} not logged within {timeout} s:\n{self.log()[-3000:]}"
        )


class Worker(Proc):
    def __init__(self, name: str, model: Path, redis_url: str, log_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.worker_id = name
        args = [
            "--model", str(model), "--bind", self.endpoint, "--redis", redis_url, "--worker-id", name,
            "--backend", "numpy", "--heartbeat-interval", str(HEARTBEAT_S),
            "--missed-heartbeats", str(MISSED), "--cancel-poll-interval", "0.1",
            # stop() at teardown drains: requests still running get a second, not a minute.
            "--drain-timeout", "1", *extra,
        ]  # fmt: skip
        super().__init__(name, "worker.service", args, log_dir)


class Gateway(Proc):
    def __init__(self, name: str, redis_url: str, log_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.gateway_id = name
        args = [
            "--bind", self.endpoint, "--redis", redis_url, "--gateway-id", name,
            "--heartbeat-interval", str(HEARTBEAT_S), "--missed-heartbeats", str(MISSED),
            "--drain-timeout", "1", *extra,  # as for workers: stop() at teardown drains
        ]  # fmt: skip
        super().__init__(name, "gateway", args, log_dir)

    def wait_workers(self, count: int, timeout: float = 30.0) -> None:
        self.wait_log("ready: [", count, timeout)


class Stack:
    """Workers and gateways against one Redis; everything is stopped on exit."""

    def __init__(self, model: Path, redis_url: str, log_dir: Path) -> None:
        self.model = model
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.workers: list[Worker] = []
        self.gateways: list[Gateway] = []
        self.redis = redis.Redis.from_url(redis_url)
        self.keys = protocol.Keys()

    def worker(self, *extra: str) -> Worker:
        w = Worker(f"worker{len(self.workers)}", self.model, self.redis_url, self.log_dir, *extra)
        self.workers.append(w)
        return w

    def gateway(self, *extra: str) -> Gateway:
        g = Gateway(f"gateway{len(self.gateways)}", self.redis_url, self.log_dir, *extra)
        self.gateways.append(g)
        return g

    def up(self, workers: int, gateways: int) -> None:
        for _ in range(workers):
            self.worker()
        for _ in range(gateways):
            self.gateway()
        for g in self.gateways:
            g.wait_workers(workers)

    def load(self, worker: Worker) -> protocol.WorkerLoad:
        """The load in the worker's latest Redis heartbeat."""
        blob = self.redis.get(self.keys.heartbeat(worker.worker_id))
        assert blob is not None, f"{worker.name} has no heartbeat in Redis"
        beat = protocol.decode(blob)  # type: ignore[arg-type]
        assert isinstance(beat, protocol.Heartbeat)
        assert beat.load is not None
        return beat.load

    def wait_idle(self, worker: Worker, timeout: float = 10.0) -> protocol.WorkerLoad:
        """Until the worker reports nothing running and every KV block free."""
        deadline = time.monotonic() + timeout
        while True:
            load = self.load(worker)
            if (
                load.num_active_requests == 0
                and load.num_queued_requests == 0
                and (load.free_num_blocks == load.max_num_blocks)
            ):
                return load
            if time.monotonic() > deadline:
                raise AssertionError(f"{worker.name} not idle after {timeout} s: {load}")
            time.sleep(0.05)

    def request_stats(self, request_id: str, timeout: float = 5.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            raw = self.redis.hgetall(self.keys.request_stats(request_id))
            if raw:
                return {k.decode(): v.decode() for k, v in raw.items()}  # type: ignore[union-attr]
            if time.monotonic() > deadline:
                raise AssertionError(f"no request stats for {request_id} in Redis after {timeout} s")
            time.sleep(0.05)

    def close(self) -> None:
        for p in [*self.gateways, *self.workers]:
            p.stop()
        self.redis.close()


@contextmanager
def stack(model: Path, redis_url: str, log_dir: Path, workers: int = 1, gateways: int = 1) -> Iterator[Stack]:
    s = Stack(model, redis_url, log_dir)
    try:
        s.up(workers, gateways)
        yield s
    finally:
        s.close()
