"""A bind reachable beyond this host with no credential in front of it refuses
to start, in one line that says what to set; --insecure starts it with a warning
at start and in /health."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ops.binds import is_local_endpoint, is_local_host
from tests.procs import REPO, Gateway, free_port


def _run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def _assert_one_line(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_public_binds_without_credentials_refuse_to_start(service_model: Path, redis_url: str) -> None:
    port = free_port()
    _assert_one_line(_run("worker.service", "--model", str(service_model), "--bind", f"tcp://0.0.0.0:{port}",
                   "--redis", redis_url, "--backend", "numpy"),
              "--bind tcp://0.0.0.0", "--curve-secret-key-file", "--insecure")  # fmt: skip
    _assert_one_line(_run("gateway", "--bind", f"tcp://*:{port}", "--redis", redis_url),
              "--bind tcp://*", "--curve-secret-key-file", "--api-keys-file", "--insecure")
    _assert_one_line(_run("gateway", "--bind", f"tcp://127.0.0.1:{port}", "--redis", redis_url,
                   "--http-port", str(free_port()), "--http-host", "0.0.0.0"),
              "--http-host 0.0.0.0", "--api-keys-file", "--insecure")  # fmt: skip
    # /metrics takes no credential: API keys on or not, beyond this host it needs --insecure
    _assert_one_line(_run("gateway", "--bind", f"tcp://127.0.0.1:{port}", "--redis", redis_url, "--api-keys-redis",
                   "--metrics-port", str(free_port()), "--metrics-host", "0.0.0.0"),
              "--metrics-host 0.0.0.0", "--insecure")  # fmt: skip
    _assert_one_line(_run("worker.service", "--model", str(service_model), "--bind", f"tcp://127.0.0.1:{port}",
                   "--redis", redis_url, "--backend", "numpy", "--metrics-port", str(free_port()),
                   "--metrics-host", "0.0.0.0"),
              "--metrics-host 0.0.0.0", "--insecure")  # fmt: skip


def test_insecure_starts_and_says_so(redis_url: str, tmp_path: Path) -> None:
    http = free_port()
    gw = Gateway("open", redis_url, tmp_path, "--http-port", str(http), "--http-host", "0.0.0.0", "--insecure",
                 "--metrics-port", str(free_port()), "--metrics-host", "0.0.0.0")  # fmt: skip
    try:
        gw.wait_log("insecure: --http-host 0.0.0.0 is reachable beyond this host")
        gw.wait_log("insecure: --metrics-host 0.0.0.0 is reachable beyond this host")
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=5) as r:
                    health = json.loads(r.read())
                break
            except urllib.error.HTTPError as e:  # 503 until a worker is ready: the body still says it
                health = json.loads(e.read())
                if "insecure" in health:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "no /health"
            time.sleep(0.2)
        assert any("--http-host 0.0.0.0" in line for line in health["insecure"]), health
    finally:
        gw.stop()


@pytest.mark.parametrize(("endpoint", "local"), [
    ("tcp://127.0.0.1:5550", True), ("tcp://localhost:5550", True), ("tcp://[::1]:5550", True),
    ("ipc:///tmp/tw.sock", True), ("inproc://x", True), ("tcp://0.0.0.0:5550", False), ("tcp://*:5550", False),
    ("tcp://10.1.2.3:5550", False), ("tcp://eth0:5550", False),
])  # fmt: skip
def test_which_endpoints_are_local(endpoint: str, local: bool) -> None:
    assert is_local_endpoint(endpoint) is local


def test_which_http_hosts_are_local() -> None:
    assert is_local_host("127.0.0.1") and is_local_host("::1") and is_local_host("localhost")
    assert not is_local_host("0.0.0.0") and not is_local_host("") and not is_local_host("example.org")
