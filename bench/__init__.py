"""Benchmarks: `make bench` (bench/run.py) prints one table per section.

The commands are the `*_bench.py` modules, tp_probe.py and plots.py (`python -m bench.<name>`);
the modules they share hold one thing each (roofline.py, device_rates.py, runner.py, ...).
A command imports the library and other commands' public names only; a library module
imports no command (tests/bench/test_imports.py)."""

import json
import socket
import time
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class SkipSection(Exception):
    """Raised by a section's `table()` when it cannot run here (no GPU, no model)."""


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def default_model() -> Path:
    """The default model's checkpoint directory (fetched once); SkipSection where it cannot be had."""
    from worker.models.default_model import DefaultModelUnavailable, resolve_model

    try:
        return resolve_model(DEFAULT_MODEL)
    except DefaultModelUnavailable as e:
        raise SkipSection(str(e)) from None


def vocab_size(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / "config.json").read_text())["vocab_size"])
