"""Each start-up error of a service process: exit status 1 and one line saying
what is wrong, no traceback; also through `tokenwire up`."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import REPO, free_port


def _run(args: list[str], timeout: float = 60) -> list[str]:
    run = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    assert run.returncode == 1, lines
    assert not any("Traceback" in line for line in lines), lines
    return lines


@pytest.fixture
def busy_port():
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s.getsockname()[1]


def _worker(service_model: Path, redis_url: str, *extra: str) -> list[str]:
    return _run(["worker.service", "--model", str(service_model), "--redis", redis_url, "--backend", "numpy",
                 "--bind", f"tcp://127.0.0.1:{free_port()}", *extra])  # fmt: skip


def test_worker_invalid_setting(service_model, redis_url):
    (line,) = _worker(service_model, redis_url, "--max-batch-size", "0")
    assert "--max-batch-size: Input should be greater than or equal to 1 (got 0)" in line


def test_worker_kv_cache_below_one_request(service_model, redis_url):
    (line,) = _worker(service_model, redis_url, "--kv-tokens", "8")
    assert "kv_tokens 8 is smaller than one KV block" in line


def test_worker_model_that_cannot_load(redis_url, tmp_path):
    (line,) = _run(["worker.service", "--model", str(tmp_path / "nothing"), "--redis", redis_url,
                    "--bind", f"tcp://127.0.0.1:{free_port()}"])  # fmt: skip
    assert f"could not load {tmp_path / 'nothing'}" in line and "no such checkpoint" in line


def test_worker_port_in_use(service_model, redis_url, busy_port):
    (line,) = _worker(service_model, redis_url, "--bind", f"tcp://127.0.0.1:{busy_port}")
    assert f"cannot listen at tcp://127.0.0.1:{busy_port}: Address already in use" in line


@pytest.mark.parametrize("which", ["--bind", "--http-port", "--metrics-port"])
def test_gateway_port_in_use(redis_url, busy_port, which):
    value = f"tcp://127.0.0.1:{busy_port}" if which == "--bind" else str(busy_port)
    (line,) = _run(["gateway", "--redis", redis_url, "--bind", f"tcp://127.0.0.1:{free_port()}", which, value])
    assert "cannot listen" in line and "Address already in use" in line


@pytest.mark.slow
def test_up_reports_a_child_that_cannot_start(service_model, redis_url, busy_port):
    lines = _run(["clients.cli", "up", "--model", str(service_model), "--redis", redis_url, "--backend", "numpy",
                  "--gateway-bind", f"tcp://127.0.0.1:{busy_port}", "--worker-bind", f"tcp://127.0.0.1:{free_port()}",
                  "--http-port", str(free_port()), "--no-demo"], timeout=120)  # fmt: skip
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, lines
    assert "the gateway exited with status 1" in errors[0] and "Address already in use" in errors[0]
    assert "tokenwire is up" not in "\n".join(lines)


def test_worker_lora_option_without_a_name(service_model, redis_url):
    (line,) = _worker(service_model, redis_url, "--lora", "adapters/sql")
    assert "--lora 'adapters/sql': give NAME=DIR" in line


def test_worker_lora_adapter_that_cannot_load(service_model, redis_url, tmp_path):
    (line,) = _worker(service_model, redis_url, "--lora", f"sql={tmp_path / 'nothing'}")
    assert f"--lora 'sql={tmp_path / 'nothing'}': {tmp_path / 'nothing'} is not a directory" in line
    # One the model must check: after it loads, still one line of error.
    lines = _worker(service_model, redis_url, "--lora", f"sql={tmp_path}")
    assert lines[-1].endswith(f"CheckpointError: LoRA adapter {tmp_path}: adapter_config.json is missing")
