"""ops.config: options from the command line, the environment and a TOML file, in
that order, validated with errors that name the key and its source; and
`tokenwire config check`."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from clients.cli import main as tokenwire
from ops.config import apply_config
from worker.service.__main__ import add_arguments


def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_arguments(p)  # ends with add_config_options(p, "worker")
    return p


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tokenwire.toml"
    path.write_text(text)
    return path


def test_command_line_beats_environment_beats_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, '[worker]\nmax_batch_size = 8\nbackend = "numpy"\nmax-num-tokens = 512\nkv_tokens = 100\n')
    monkeypatch.setenv("TOKENWIRE_WORKER_KV_TOKENS", "4096")
    monkeypatch.setenv("TOKENWIRE_WORKER_HEARTBEAT_INTERVAL", "2.5")
    args = _worker_parser().parse_args(["--config", str(path), "--backend", "echo"])
    apply_config(args)
    assert args.backend == "echo"  # command line
    assert args.kv_tokens == 4096  # environment over file, converted to the option's type
    assert args.heartbeat_interval == 2.5
    assert args.max_batch_size == 8  # file
    assert args.max_num_tokens == 512  # dashes as on the command line work too
    assert args.redis_prefix == "tokenwire"  # default


def test_config_file_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENWIRE_CONFIG", str(_write(tmp_path, "[worker]\nmax_batch_size = 3\n")))
    args = _worker_parser().parse_args([])
    apply_config(args)
    assert args.max_batch_size == 3


def test_bad_values_name_the_key_and_where_it_came_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, '[worker]\nmax_batch_size = "lots"\nmax_batch_sise = 3\n')
    monkeypatch.setenv("TOKENWIRE_WORKER_BACKEND", "cuda")
    args = _worker_parser().parse_args(["--config", str(path)])
    with pytest.raises(SystemExit) as e:
        apply_config(args)
    text = str(e.value)
    assert f"{path}: [worker] max_batch_size: Input should be a valid integer" in text
    assert "unknown key 'max_batch_sise'" in text
    assert "$TOKENWIRE_WORKER_BACKEND: Input should be 'auto', 'numpy', 'torch' or 'echo' (got 'cuda')" in text


def test_config_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path, "[worker]\nmax_batch_size = 8\n[gateway]\nmax_inflight = 10\n")
    assert tokenwire(["config", "check", str(good)]) == 0
    assert "ok" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text('[gateway]\nmax_inflight = -x\n')
    assert tokenwire(["config", "check", str(bad)]) == 1
    assert "not valid TOML" in capsys.readouterr().err
    bad.write_text('[gatway]\n[jobs_consumer]\nmax_in_flight = "many"\n')
    assert tokenwire(["config", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "[gatway]: unknown table" in err
    assert "[jobs_consumer] max_in_flight: Input should be a valid integer" in err


def test_the_shipped_example_passes_check() -> None:
    example = Path(__file__).resolve().parents[2] / "ops" / "tokenwire.toml"
    assert tokenwire(["config", "check", str(example)]) == 0
