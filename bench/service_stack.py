"""The service on this machine for a bench: a private redis-server, workers and gateway
processes as children, CURVE on between them when asked."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench import SkipSection, free_port
from bench.process_cpu import cpu_seconds
from ops.compute_threads import usable_cores
from ops.process import spawned, stop_children

if TYPE_CHECKING:
    from ops.curve import ClientCurve

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Front:
    """One more gateway of a stack (`Stack.add_gateway`): its own ZeroMQ and HTTP ports."""

    endpoint: str
    http_port: int
    proc: subprocess.Popen[bytes]


class Stack:
    """A private redis-server, `workers` workers (one by default) and `gateways` gateway
    processes (one by default; several share one HTTP port, each with a ZeroMQ port of its own:
    `self.gateways`), as child processes; `worker_args` go to each worker's command line (its KV
    cache size among them), `gateway_args` to each gateway's; with `curve`, CURVE on between
    them all (keys made in the stack's directory)."""

    def __init__(self, model: Path, *worker_args: str, curve: bool = False, gateway_args: Sequence[str] = (),
                 workers: int = 1, gateways: int = 1) -> None:  # fmt: skip
        redis_server = shutil.which("redis-server")
        if redis_server is None:
            raise SkipSection("redis-server is not on PATH")
        self.dir = tempfile.TemporaryDirectory(prefix="tokenwire-bench-")
        ports = [free_port() for _ in range(1 + gateways)]
        self.redis = f"redis://127.0.0.1:{ports[0]}/0"
        self.gateways = [f"tcp://127.0.0.1:{port}" for port in ports[1:]]
        self.gateway = self.gateways[0]
        self.http_port = free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self._env = env
        log = self._log = open(Path(self.dir.name) / "log", "wb")  # noqa: SIM115 - closed with the directory
        redis_args = [redis_server, "--port", str(ports[0]), "--save", "", "--appendonly", "no"]
        self.procs = [subprocess.Popen(redis_args, stdout=subprocess.DEVNULL)]
        time.sleep(0.3)
        self.client_curve: ClientCurve | None = None
        worker_curve, gateway_curve = self._curve_args(Path(self.dir.name)) if curve else ([], [])
        py = sys.executable
        # The model's math on as many threads as the in-process Executor it is compared with
        # (a worker leaves a core to its neighbours by default): the rows then differ by the
        # service path alone. A --cpu-threads in worker_args comes later and wins.
        same_threads = ["--cpu-threads", str(usable_cores())]
        self.workers = [subprocess.Popen(
            [py, "-m", "worker.service", "--model", str(model), "--bind", f"tcp://127.0.0.1:{free_port()}",
             "--redis", self.redis, *same_threads, *worker_args, *worker_curve],
            env=env, stdout=log, stderr=subprocess.STDOUT) for _ in range(workers)]  # fmt: skip
        shared = ["--http-reuse-port"] if gateways > 1 else []
        self.gateway_procs = [subprocess.Popen(
            [py, "-m", "gateway", "--bind", endpoint, "--redis", self.redis, "--no-worker-timeout", "300",
             "--http-port", str(self.http_port), *shared, *gateway_curve, *gateway_args],
            env=env, stdout=log, stderr=subprocess.STDOUT) for endpoint in self.gateways]  # fmt: skip
        self.gateway_proc = self.gateway_procs[0]
        self.procs += [*self.workers, *self.gateway_procs]
        self._wait_healthy(300.0, workers * gateways)

    def add_gateway(self, *gateway_args: str) -> Front:
        """Another gateway on this stack's Redis, in front of the same workers (no CURVE), with
        ports of its own; once its /health says a worker is ready. Stopped with the stack."""
        endpoint, http_port = f"tcp://127.0.0.1:{free_port()}", free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--bind", endpoint, "--redis", self.redis, "--no-worker-timeout", "300",
             "--http-port", str(http_port), *gateway_args],
            env=self._env, stdout=self._log, stderr=subprocess.STDOUT)  # fmt: skip
        self.procs.append(proc)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return Front(endpoint, http_port, proc)
            except OSError:  # not listening yet, or 503 until a worker is ready
                pass
            time.sleep(0.5)
        tail = (Path(self.dir.name) / "log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the added gateway did not become healthy:\n{tail}")

    def _wait_healthy(self, timeout_s: float, workers: int) -> None:
        """Until /health says 200 (Redis answers and a worker is ready) and the gateways have
        logged `workers` workers ready, all told: the clients fail fast, so they must not race
        the model's load."""
        deadline = time.monotonic() + timeout_s
        url = f"http://127.0.0.1:{self.http_port}/health"
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                tail = (Path(self.dir.name) / "log").read_text(errors="replace")[-2000:]
                self.close()
                raise RuntimeError(f"the service stack ended while starting:\n{tail}")
            try:
                with urllib.request.urlopen(url, timeout=2) as answer:
                    ready = (Path(self.dir.name) / "log").read_text(errors="replace").count(" ready: [")
                    if answer.status == 200 and ready >= workers:
                        return
            except OSError:  # not listening yet, or 503 until a worker is ready
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"the service stack was not healthy within {timeout_s:.0f} s")

    def _curve_args(self, root: Path) -> tuple[list[str], list[str]]:
        from ops import curve

        for name, allowed_by in (("worker", "workers"), ("gateway", "gateways"), ("client", "clients")):
            public, _ = curve.generate(root / "keys", name)
            (root / allowed_by).mkdir()
            shutil.copy(public, root / allowed_by)
        self.client_curve = curve.ClientCurve.from_files(
            root / "keys" / "client.key_secret", root / "keys" / "gateway.key"
        )
        return (
            ["--curve-secret-key-file", str(root / "keys" / "worker.key_secret"),
             "--curve-allowed-keys-dir", str(root / "gateways")],
            ["--curve-secret-key-file", str(root / "keys" / "gateway.key_secret"),
             "--curve-allowed-keys-dir", str(root / "clients"), "--curve-worker-keys-dir", str(root / "workers")],
        )  # fmt: skip

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of the gateways, the worker processes (sockets, Redis, bookkeeping)
        and their engine processes (the model's steps), each kind summed."""
        engines = [e for w in self.workers for e in spawned(w.pid)]
        return {"gateway": sum(cpu_seconds(g.pid) for g in self.gateway_procs),
                "worker": sum(cpu_seconds(w.pid) for w in self.workers),
                "engine": sum(cpu_seconds(e) for e in engines) if engines else float("nan")}

    def close(self) -> None:
        stop_children(self.procs, timeout_s=10)
        self.dir.cleanup()
