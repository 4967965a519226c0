"""`tokenwire up` (what `make run` runs): a worker, a gateway with its HTTP front and a
job consumer as child processes, a streamed chat demo not mixed with their logs,
then serving requests (ZeroMQ, HTTP, jobs) until Ctrl-C, which stops every child."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import redis

from clients.client import Client
from clients.jobs import JobQueue, JobStatus
from ops.process import children as process_children
from tests.procs import REPO, free_port, running


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    out: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return out


def _read_until(lines: queue.Queue[str], marker: str, timeout: float) -> str:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        seen.append(line)
        if marker in line:
            return "".join(seen)
    raise AssertionError(f"no {marker!r} within {timeout} s; output so far:\n{''.join(seen)}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT does not count
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _up(service_model: Path, redis_url: str, ports: list[int], log_dir: Path, *extra: str) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "clients.cli", "up", "--model", str(service_model), "--redis", redis_url,
            "--gateway-bind", f"tcp://127.0.0.1:{ports[0]}", "--worker-bind", f"tcp://127.0.0.1:{ports[1]}",
            "--http-port", str(ports[2]), "--backend", "numpy", "--log-dir", str(log_dir), *extra]  # fmt: skip
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _stop(proc: subprocess.Popen[str]) -> None:
    """As an operator would: SIGTERM (which stops the children too), kill -9 only if that fails."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_up_runs_a_demo_serves_and_stops_on_ctrl_c(service_model: Path, redis_url: str, tmp_path: Path) -> None:
    ports = [free_port(), free_port(), free_port()]
    gateway = f"tcp://127.0.0.1:{ports[0]}"
    log_dir = tmp_path / "logs"
    proc = _up(service_model, redis_url, ports, log_dir, "--max-tokens", "6")
    try:
        lines = _lines(proc)
        out = _read_until(lines, "serving;", timeout=90)
        up_at = time.monotonic()
        assert "tokenwire is up" in out
        assert re.search(r"\[[1-6] tokens in [0-9.]+ s, first token after \d+ ms\]", out), out
        assert " INFO " not in out, "the children's logs go to files, not between the demo's text"

        # Up means every child listens: HTTP answers healthy, a consumer runs jobs.
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[2]}/health", timeout=5) as r:
            assert r.status == 200
        with JobQueue(redis_url) as q:
            job = q.submit("The quick brown fox", max_tokens=3, temperature=0.0)
            assert q.result(job, timeout=30).status == JobStatus.DONE

        # The gateway got its tokenizer from the worker: text prompts work.
        with Client([gateway]) as client:
            result = client.generate("The quick brown fox", max_tokens=4, min_tokens=4, temperature=0.0, timeout=30)
        assert len(result.token_ids) == 4 and result.text

        # Still serving once the children have sent more notifications (STATUS each second,
        # WATCHDOG=1) than an unread notify socket queues (10): `up` reads them all along.
        time.sleep(max(0.0, up_at + 12 - time.monotonic()))
        with Client([gateway]) as client:
            assert len(client.generate("Again", max_tokens=2, min_tokens=2, timeout=30).token_ids) == 2
        for name in ("worker", "gateway", "consumer"):
            assert "queue is full" not in (log_dir / f"{name}.log").read_text(), f"the {name}'s notifications piled up"

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "stopping" in out + _read_until(lines, "stopping", timeout=5)
        assert all(_bindable(port) for port in ports), "a child still holds its port"
    finally:
        _stop(proc)


def test_sigterm_stops_up_and_its_children_as_ctrl_c_does(service_model: Path, redis_url: str, tmp_path: Path) -> None:
    ports = [free_port(), free_port(), free_port()]
    proc = _up(service_model, redis_url, ports, tmp_path / "logs", "--no-demo", "--no-consumer")
    try:
        lines = _lines(proc)
        _read_until(lines, "serving;", timeout=90)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        _read_until(lines, "stopping", timeout=5)
        assert all(_bindable(port) for port in ports), "a child still holds its port"
    finally:
        _stop(proc)


def test_kill_9_of_up_stops_its_children(service_model: Path, redis_url: str, tmp_path: Path) -> None:
    """up cannot stop anything when it is killed with SIGKILL: its children get SIGTERM from
    the kernel then (ops.process.stop_with_launcher), and drain and exit as on a supervisor's."""
    ports = [free_port(), free_port(), free_port()]
    log_dir = tmp_path / "logs"
    proc = _up(service_model, redis_url, ports, log_dir, "--no-demo")
    children: list[int] = []
    try:
        _read_until(_lines(proc), "serving;", timeout=90)
        children = process_children(proc.pid)
        assert len(children) == 3, children  # worker, gateway, consumer (the test's Redis is its own)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while any(running(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(running(pid) for pid in children), [p for p in children if running(p)]
        assert all(_bindable(port) for port in ports), "a child still holds its port"
        assert "drain" in (log_dir / "worker.log").read_text().lower(), "the worker did not stop as on SIGTERM"
    finally:
        _stop(proc)
        for pid in children:  # reparented once up is gone: only this list still names them
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_ps_shows_no_redis_password_for_anything_up_started(service_model: Path, redis_server_factory,
                                                            tmp_path: Path) -> None:  # fmt: skip
    server = redis_server_factory()
    password = "sesame-" + os.urandom(6).hex()
    with redis.Redis(port=server.port) as r:
        r.config_set("requirepass", password)
    password_file = tmp_path / "redis-password"
    password_file.write_text(password + "\n")
    ports = [free_port(), free_port(), free_port()]
    proc = _up(service_model, f"redis://127.0.0.1:{server.port}/0", ports, tmp_path / "logs", "--no-demo",
               "--redis-password-file", str(password_file))  # fmt: skip
    try:
        out = _read_until(_lines(proc), "serving;", timeout=90)  # up: every child reached Redis with the password
        assert password not in out
        table = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True, check=True).stdout
        children = [line for line in table.splitlines()[1:] if line.split(None, 2)[1] == str(proc.pid)]
        assert len(children) == 3, table  # worker, gateway, consumer
        for line in children:
            assert password not in line and "--redis" not in line, line
    finally:
        _stop(proc)
