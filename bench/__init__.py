"""Benchmarks: `make bench` (bench/run.py) prints one table per section."""

import socket
import time


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
