"""A fleet on this machine for a bench: a private redis-server, two workers of one model and
one gateway per router, as child processes; their output in one log."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from bench import SkipSection, free_port
from ops.process import stop_children

REPO = Path(__file__).resolve().parents[1]


class Fleet:
    """`gateways[router]`: (ZeroMQ endpoint, metrics port, HTTP port) of the gateway routing by
    `router`; `workers`: the worker processes (one compute thread each), `worker_args` on
    their command lines."""

    def __init__(self, model: Path, routers: Sequence[str], *worker_args: str) -> None:
        redis_server = shutil.which("redis-server")
        if redis_server is None:
            raise SkipSection("redis-server is not on PATH")
        self.dir = tempfile.TemporaryDirectory(prefix="tokenwire-fleet-")
        self.redis = f"redis://127.0.0.1:{free_port()}/0"
        self.gateways = {r: (f"tcp://127.0.0.1:{free_port()}", free_port(), free_port()) for r in routers}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.log = Path(self.dir.name) / "log"
        log = self.log.open("wb")
        port = self.redis.rsplit(":", 1)[1].split("/")[0]
        self.procs = [subprocess.Popen([redis_server, "--port", port, "--save", "", "--appendonly", "no"],
                                       stdout=subprocess.DEVNULL)]  # fmt: skip
        time.sleep(0.3)
        py = sys.executable
        self.workers = [subprocess.Popen(
            [py, "-m", "worker.service", "--model", str(model), "--bind", f"tcp://127.0.0.1:{free_port()}",
             "--redis", self.redis, "--worker-id", f"worker{i}", "--cpu-threads", "1", "--kv-tokens", "16384",
             *worker_args],
            env=env, stdout=log, stderr=subprocess.STDOUT) for i in range(2)]  # fmt: skip
        self.procs += self.workers
        for router, (bind, metrics, http) in self.gateways.items():
            self.procs.append(subprocess.Popen(
                [py, "-m", "gateway", "--bind", bind, "--redis", self.redis, "--router", router,
                 "--gateway-id", f"gw-{router}", "--metrics-port", str(metrics), "--http-port", str(http),
                 "--no-worker-timeout", "300"],
                env=env, stdout=log, stderr=subprocess.STDOUT))  # fmt: skip

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until every gateway logs both workers ready."""
        deadline = time.monotonic() + timeout_s
        while self.log.read_text(errors="replace").count("ready: [") < 2 * len(self.gateways):
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-2000:]
                self.close()
                raise RuntimeError(f"the fleet did not come up:\n{tail}")
            time.sleep(0.5)

    def metrics(self, router: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.gateways[router][1]}/metrics", timeout=10) as r:
            return str(r.read().decode())

    def close(self) -> None:
        stop_children(self.procs, timeout_s=10)
        self.dir.cleanup()
