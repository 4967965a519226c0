"""Fixtures shared by every test: private Redis servers, and GPU test selection.

Standard library only at import time: `make test-gpu` runs on a host that has
numpy and torch but no redis, zmq or pydantic.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest

REDIS_START_TIMEOUT_S = 10.0


class RedisServer:
    """A private redis-server on a free loopback port, data in its own directory."""

    def __init__(self, workdir: Path, *, appendonly: bool = False) -> None:
        self.workdir = workdir
        self.appendonly = appendonly
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start on a fresh free port, or on the same port again after `stop` (so
        clients holding the URL can reconnect to a restarted server)."""
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not on PATH: run the tests through `make test`, which installs it")
        fixed_port = self.port != 0
        for _ in range(5):
            port = self.port if fixed_port else _free_port()
            args = [
                binary,
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--dir", str(self.workdir),
                "--save", "",
                "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "always",
                "--logfile", "redis.log",
            ]  # fmt: skip
            self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready(port):
                self.port = port
                return
            self.stop()
        log = self.workdir / "redis.log"
        detail = log.read_text()[-2000:] if log.exists() else "(no log)"
        pytest.fail(f"redis-server did not start in {self.workdir}:\n{detail}")

    def stop(self) -> None:
        """Graceful shutdown: with appendonly, everything acknowledged is on disk."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def _wait_ready(self, port: int) -> bool:
        assert self.process is not None
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False  # exited, most likely the port was taken meanwhile
            if _ping(port):
                return True
            time.sleep(0.02)
        return False


def _free_port() -> int:
    """A free loopback port below the kernel's ephemeral range. Tests stop Redis and
    start it again on its port while clients keep reconnecting; a port inside the
    range can be taken meanwhile by such a client's own connection to itself (TCP
    simultaneous open picks the target port as the source port), and then the
    restarted server cannot bind it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    while True:
        port = rng.randrange(10000, max(low, 10001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def _ping(port: int) -> bool:
    """One RESP PING, without a Redis client library."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One Redis for the session, no persistence. Tests that share it get a clean
    database through `redis_url`."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the session's Redis, emptied (FLUSHALL) before the test."""
    with socket.create_connection(("127.0.0.1", redis_server.port), timeout=5) as s:
        s.sendall(b"FLUSHALL\r\n")
        assert s.recv(64).startswith(b"+OK"), "FLUSHALL failed"
    return redis_server.url


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start dedicated servers, e.g. `redis_server_factory(appendonly=True)` for a
    test that restarts or kills Redis. All are stopped after the test."""
    servers: list[RedisServer] = []

    def start(*, appendonly: bool = False) -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{len(servers)}", appendonly=appendonly)
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.kill()


def _gpu_run(config: pytest.Config) -> bool:
    return "gpu" in (config.getoption("markexpr") or "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests run only where CUDA is (make test-gpu); elsewhere they skip."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items or _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make test-gpu on a GPU host)")
    for item in gpu_items:
        item.add_marker(skip)


def _cuda_available() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# Where the GPU host lacks a package (pyzmq, redis, pydantic: absent there by
# design), the tests needing it are left out of `-m gpu` runs instead of erroring.
_NOT_ON_THIS_HOST: list[str] = []
_MISSING_RE = re.compile(r"ModuleNotFoundError: (No module named '[^']+')")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """A test module that cannot import a missing package: skipped, with the reason."""
    report = yield
    if report.failed and _gpu_run(collector.config):
        missing = _MISSING_RE.search(str(report.longrepr))
        if missing:
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), 0, f"Skipped: not on this host: {missing.group(1)}")
    return report


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A test folder whose conftest cannot be imported here: left out. Its conftest
    is tried in a child process, since pytest cannot recover from a failed one."""
    conftest = collection_path / "conftest.py"
    if not _gpu_run(config) or collection_path == config.rootpath / "tests" or not conftest.is_file():
        return None
    root = str(config.rootpath)
    probe = f"import runpy, sys; sys.path.insert(0, {root!r}); runpy.run_path({str(conftest)!r})"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    missing = _MISSING_RE.search(done.stderr)
    if done.returncode != 0 and missing:
        _NOT_ON_THIS_HOST.append(f"{collection_path.relative_to(config.rootpath)}/: {missing.group(1)}")
        return True
    return None


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    return [f"left out, not on this host: {line}" for line in _NOT_ON_THIS_HOST]
