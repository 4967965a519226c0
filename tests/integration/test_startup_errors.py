"""Each start-up error of a service process: exit status 1 and one line saying
what is wrong, no traceback; also through `tokenwire up`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import REPO, Gateway, Worker, free_port


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


def test_a_worker_holds_its_port_while_its_model_loads(service_model, redis_url, tmp_path):
    """Bound before the model loads, and kept: a second worker on the port fails at once
    with one line, not after its own load (minutes on a GPU) with a traceback. The load is
    held here by a config.json that is a FIFO: reading it waits until the test writes it."""
    model = tmp_path / "held-model"
    model.mkdir()
    for item in service_model.iterdir():
        if item.name != "config.json":
            (model / item.name).symlink_to(item)
    os.mkfifo(model / "config.json")
    first = Worker("first", model, redis_url, tmp_path)
    try:
        deadline = time.monotonic() + 30
        while True:  # the port takes connections while the load waits on config.json
            try:
                socket.create_connection(("127.0.0.1", first.port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and first.alive, first.log()
                time.sleep(0.05)
        (line,) = _worker(service_model, redis_url, "--bind", first.endpoint, "--metrics-port", str(free_port()))
        assert f"cannot listen at {first.endpoint}: Address already in use" in line
        writer = os.open(model / "config.json", os.O_WRONLY)  # the loader is waiting to read it
        (tmp_path / "config.json").write_bytes((service_model / "config.json").read_bytes())
        os.replace(tmp_path / "config.json", model / "config.json")  # later reads find a plain file
        os.write(writer, (service_model / "config.json").read_bytes())
        os.close(writer)
        first.wait_log("serving")
    finally:
        first.stop()


def test_worker_metrics_port_in_use(service_model, redis_url, busy_port):
    (line,) = _worker(service_model, redis_url, "--metrics-port", str(busy_port))
    assert f"cannot serve /metrics at 127.0.0.1:{busy_port}: Address already in use" in line


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


def test_up_with_a_model_that_does_not_exist(redis_url, tmp_path):
    lines = _run(["clients.cli", "up", "--model", str(tmp_path / "nothing"), "--redis", redis_url, "--no-demo"])
    assert lines[-1].startswith(f"error: {tmp_path / 'nothing'}: no such checkpoint directory"), lines


def test_a_redis_that_refuses_the_password_is_reported(service_model, tmp_path):
    """A refused Redis password is reported at start-up, not left as a gateway without workers."""
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--requirepass", "right-one", "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL)  # fmt: skip
    wrong = tmp_path / "password"
    wrong.write_text("wrong-one\n")
    url = f"redis://127.0.0.1:{port}/0"
    procs = [Gateway("gw", url, tmp_path, "--redis-password-file", str(wrong)),
             Worker("w", service_model, url, tmp_path, "--redis-password-file", str(wrong))]  # fmt: skip
    try:
        for p in procs:
            p.wait_log("redis: cannot reach it (", timeout=30)
            assert "password" in p.log().split("redis: cannot reach it (")[1].split(")")[0]
            assert "wrong-one" not in p.log()
    finally:
        for p in procs:
            p.stop()
        server.terminate()
        server.wait()


def test_worker_lora_option_without_a_name(service_model, redis_url):
    (line,) = _worker(service_model, redis_url, "--lora", "adapters/sql")
    assert "--lora 'adapters/sql': give NAME=DIR" in line


def test_worker_lora_adapter_that_cannot_load(service_model, redis_url, tmp_path):
    (line,) = _worker(service_model, redis_url, "--lora", f"sql={tmp_path / 'nothing'}")
    assert f"--lora 'sql={tmp_path / 'nothing'}': {tmp_path / 'nothing'} is not a directory" in line
    # One the model must check: after it loads, still one line of error.
    lines = _worker(service_model, redis_url, "--lora", f"sql={tmp_path}")
    assert lines[-1].endswith(f"CheckpointError: LoRA adapter {tmp_path}: adapter_config.json is missing")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--role", "decode"], "--role decode needs --kv-bind"),
        (["--role", "prefill", "--tensor-parallel-size", "2"], "tensor and pipeline parallel workers run whole"),
    ],
)
def test_worker_disaggregation_options_that_cannot_serve(service_model, redis_url, args, says):
    (line,) = _worker(service_model, redis_url, *args)
    assert says in line


def test_worker_cuda_ipc_transfers_without_a_cuda_kv_cache(service_model, redis_url):
    lines = _worker(service_model, redis_url, "--role", "prefill", "--kv-transfer", "cuda-ipc")
    assert lines[-1].endswith("--kv-transfer cuda-ipc: this worker's KV cache is not on a CUDA device; "
                              "use frames or auto")  # fmt: skip
