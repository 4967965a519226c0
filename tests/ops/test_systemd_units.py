"""The unit files in ops/systemd: `systemd-analyze verify` accepts them, they say what
a drained, watched, GPU-reaching service needs, and the worker's port arithmetic works.

verify checks that ExecStart's binary exists, so each unit is checked in a copy whose
installed path (/opt/tokenwire/venv/bin/tokenwire) points at a stub made here.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "ops" / "systemd"
INSTALLED = "/opt/tokenwire/venv/bin/tokenwire"
SERVICES = [
    "tokenwire-worker@.service",
    "tokenwire-worker-tp@.service",
    "tokenwire-gateway.service",
    "tokenwire-gateway@.service",
    "tokenwire-jobs-consumer.service",
]


def _unit(name: str) -> configparser.ConfigParser:
    # Repeated keys (DeviceAllow=, EnvironmentFile=) are legal in units: keep the last,
    # and read the repeats from the text where they matter.
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(UNITS / name)
    return parser


def _stub(tmp_path: Path) -> Path:
    """An executable that prints its arguments, one per line."""
    stub = tmp_path / "bin" / "tokenwire"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    stub.chmod(0o755)
    return stub


@pytest.fixture
def units(tmp_path: Path) -> Path:
    stub = _stub(tmp_path)
    out = tmp_path / "units"
    out.mkdir()
    for unit in UNITS.iterdir():
        (out / unit.name).write_text(unit.read_text().replace(INSTALLED, str(stub)))
    return out


def test_every_unit_passes_systemd_analyze_verify(units: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is missing: `make test` installs Debian's systemd package")
    names = sorted(p.name for p in units.iterdir())
    assert set(names) == {*SERVICES, "tokenwire.target"}
    for name in names:
        target = name.replace("@.", "@0.")  # a template is verified through one instance
        run = subprocess.run(
            [analyze, "verify", "--man=no", f"./{target}"], cwd=units, capture_output=True, text=True, timeout=60
        )
        # verify exits 0 on unknown keys and bad values (it ignores them), but says so on stderr.
        assert run.returncode == 0 and run.stderr.strip() == "", f"{name}:\n{run.stderr}"


@pytest.mark.parametrize("name", SERVICES)
def test_services_are_drained_restarted_and_run_as_their_own_user(name: str) -> None:
    service = _unit(name)["Service"]
    assert service["KillMode"] == "mixed"
    assert service["Restart"] == "on-failure"
    assert service["User"] == "tokenwire"
    assert service["EnvironmentFile"].lstrip("-").startswith("/etc/tokenwire/")
    assert "[Install]" in (UNITS / name).read_text()


@pytest.mark.parametrize("name", SERVICES)
def test_services_speak_notify_and_are_watched(name: str) -> None:
    service = _unit(name)["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert int(service["WatchdogSec"]) > 0


def test_worker_reaches_the_gpu_and_outlasts_its_drain() -> None:
    import argparse

    from worker.service.__main__ import add_arguments

    worker = argparse.ArgumentParser()
    add_arguments(worker)
    text = (UNITS / "tokenwire-worker@.service").read_text()
    service = _unit("tokenwire-worker@.service")["Service"]
    assert not any(line.startswith("PrivateDevices") for line in text.splitlines())
    assert service["DevicePolicy"] == "closed"
    allowed = {line.split("=", 1)[1].split()[0] for line in text.splitlines() if line.startswith("DeviceAllow=")}
    assert {"char-nvidiactl", "char-nvidia-frontend", "char-nvidia-uvm"} <= allowed
    assert "CUDA_VISIBLE_DEVICES=%i" in text
    assert int(service["TimeoutStopSec"]) > worker.get_default("drain_timeout") + 10


def _run_exec_start(tmp_path: Path, unit: str, instance: str) -> list[str]:
    """The unit's ExecStart run as systemd would for `instance` (specifiers and $$ and %% expanded)."""
    stub = _stub(tmp_path)
    stub.write_text('#!/bin/sh\necho "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"\nfor a in "$@"; do echo "$a"; done\n')
    exec_start = _unit(unit)["Service"]["ExecStart"]
    command = exec_start.replace(INSTALLED, str(stub)).replace("%%", "%").replace("%i", instance)
    command = command.replace("%H", "host").replace("$$", "$")
    argv = ["/bin/sh", "-c", command.split("'", 2)[1]]
    env = {**os.environ, **_unit_environment(unit)}
    return subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout.splitlines()


def _unit_environment(unit: str) -> dict[str, str]:
    """The unit's Environment= settings, as systemd hands them to ExecStart."""
    lines = (UNITS / unit).read_text().splitlines()
    pairs = [line.split("=", 1)[1] for line in lines if line.startswith("Environment=")]
    return dict(pair.split("=", 1) for pair in pairs)


def test_tensor_parallel_worker_takes_its_gpus_from_the_instance(tmp_path: Path) -> None:
    """Instance 2-3: GPUs 2 and 3 visible, TP=2, the port and metrics port of GPU 2."""
    text = (UNITS / "tokenwire-worker-tp@.service").read_text()
    assert "CUDA_VISIBLE_DEVICES=$$gpus exec" in text
    out = _run_exec_start(tmp_path, "tokenwire-worker-tp@.service", "2-3")
    assert out[0] == "CUDA_VISIBLE_DEVICES=2,3"
    assert out[out.index("--tensor-parallel-size") + 1] == "2"
    assert out[out.index("--bind") + 1] == "tcp://0.0.0.0:5602"
    assert out[out.index("--metrics-port") + 1] == "9602"
    assert out[out.index("--worker-id") + 1] == "host-gpus2-3"


def test_gateway_instances_share_the_http_port_and_take_ports_of_their_own(tmp_path: Path) -> None:
    """Instance 3: ZeroMQ port and metrics port 3 past the bases, its own id, the HTTP port shared."""
    out = _run_exec_start(tmp_path, "tokenwire-gateway@.service", "3")
    assert out[out.index("--bind") + 1] == "tcp://0.0.0.0:5553"
    assert out[out.index("--metrics-port") + 1] == "9553"
    assert out[out.index("--gateway-id") + 1] == "host-gw3"
    assert "--http-reuse-port" in out


def test_worker_instance_sets_its_port_from_the_gpu_index(tmp_path: Path) -> None:
    """Run the unit's ExecStart as systemd would for instance 2 (specifiers and $$ expanded)."""
    stub = _stub(tmp_path)
    exec_start = _unit("tokenwire-worker@.service")["Service"]["ExecStart"]
    command = exec_start.replace(INSTALLED, str(stub)).replace("%i", "2").replace("%H", "host").replace("$$", "$")
    argv = ["/bin/sh", "-c", command.split("'", 2)[1]]
    env = {
        **os.environ,
        "TOKENWIRE_BIND_HOST": "0.0.0.0",
        "TOKENWIRE_PORT_BASE": "5600",
        "TOKENWIRE_METRICS_PORT_BASE": "9600",
    }
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[out.index("--bind") + 1] == "tcp://0.0.0.0:5602"
    assert out[out.index("--metrics-port") + 1] == "9602"
    assert out[out.index("--worker-id") + 1] == "host-gpu2"


@pytest.mark.parametrize(
    ("name", "threshold"),
    [("tokenwire-worker@.service", 40), ("tokenwire-gateway.service", 20), ("tokenwire-gateway@.service", 20),
     ("tokenwire-jobs-consumer.service", 20)],
)
def test_hardening_keeps_the_exposure_score_low(units: Path, name: str, threshold: int) -> None:
    """`systemd-analyze security` scores 0 (locked down) to 10 (exposed); the worker's GPU
    access and generated code cost it points the others do not pay."""
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None
    run = subprocess.run(
        [analyze, "security", "--offline=yes", "--root=/", f"--threshold={threshold}", "--no-pager",
         f"./{name.replace('@.', '@0.')}"],
        cwd=units, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr


def test_the_units_config_turns_curve_on_for_every_service() -> None:
    """CURVE on by default in production: each unit reads tokenwire.toml, which
    gives every service its key pair, and the servers their allow lists."""
    config = tomllib.loads((UNITS.parent / "tokenwire.toml").read_text())
    for name in SERVICES:
        assert "--config /etc/tokenwire/tokenwire.toml" in _unit(name)["Service"]["ExecStart"], name
    for section in ("worker", "gateway", "jobs_consumer"):
        assert config[section]["curve_secret_key_file"].startswith("/etc/tokenwire/curve/"), section
    assert config["worker"]["curve_allowed_keys_dir"] and config["gateway"]["curve_allowed_keys_dir"]
    assert config["gateway"]["curve_worker_keys_dir"] and not config["gateway"].get("curve_allow_any", False)


def test_no_unit_puts_redis_credentials_in_argv() -> None:
    """`ps` shows every user a process's argv: the units give Redis through the config
    file, and lead a password to --redis-password-file (redis_password_file there)."""
    for name in SERVICES:
        start = _unit(name)["Service"]["ExecStart"]
        assert "redis://" not in start and "--redis " not in start, name
    config_text = (UNITS.parent / "tokenwire.toml").read_text()
    config = tomllib.loads(config_text)
    for section in ("worker", "gateway", "jobs_consumer"):
        assert "@" not in config[section]["redis"], section  # no user:password@ in the URL
    assert config_text.count('# redis_password_file = "/etc/tokenwire/redis-password"') == 3
