"""The `tokenwire` console script, run as a real subprocess."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import types
from importlib.metadata import version
from pathlib import Path

import pytest

from clients import cli


def tokenwire(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, the one next to this interpreter."""
    exe = shutil.which("tokenwire", path=str(Path(sys.executable).parent))
    assert exe is not None, "the tokenwire script is not installed: run `make test`"
    command = [exe]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60, check=False)


def test_version():
    done = tokenwire("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"tokenwire {version('tokenwire')}"


def test_help():
    done = tokenwire("--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: tokenwire")
    assert "--version" in done.stdout


def test_unknown_command_fails_with_usage():
    done = tokenwire("no-such-command")
    assert done.returncode == 2
    assert "invalid choice: 'no-such-command'" in done.stderr


def test_a_registered_command_is_dispatched(monkeypatch: pytest.MonkeyPatch, capsys):
    module = types.ModuleType("fake_command")

    def run(args: argparse.Namespace) -> int:
        print(f"hello {args.name}")
        return 3

    def register(subparsers) -> None:
        parser = subparsers.add_parser("hello", help="say hello")
        parser.add_argument("name")
        parser.set_defaults(handler=run)

    module.register = register  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_command", module)
    assert cli.main(["hello", "world"], commands=["fake_command"]) == 3
    assert capsys.readouterr().out == "hello world\n"
    assert cli.main([], commands=["fake_command"]) == 2
    assert "hello" in capsys.readouterr().out
