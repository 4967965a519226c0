"""The manager's side of the systemd notify protocol, for tests that run a service
process under a NOTIFY_SOCKET of their own (the process inherits it from the environment)."""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

WATCHDOG_USEC = 200_000  # the process pings every 0.1 s


class NotifySocket:
    """The manager's side of the notify protocol: one datagram per message."""

    def __init__(self) -> None:
        # AF_UNIX paths are short (108 bytes): not under pytest's deep tmp dirs.
        self.dir = Path(tempfile.mkdtemp(prefix="tw-notify-"))
        self.path = str(self.dir / "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.messages: list[tuple[float, dict[str, str]]] = []

    def receive(self, timeout: float) -> dict[str, str] | None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        fields = dict(line.split("=", 1) for line in data.decode().splitlines())
        self.messages.append((time.monotonic(), fields))
        return fields

    def wait_for(self, key: str, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            fields = self.receive(left)
            if fields is not None and key in fields:
                return fields
        raise AssertionError(f"no {key} within {timeout} s; got {[m for _, m in self.messages]}")

    def kinds(self) -> list[str]:
        order = ("READY", "STOPPING", "WATCHDOG")
        return [next((k for k in order if k in m), "STATUS") for _, m in self.messages]

    def close(self) -> None:
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def notify_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    """A notify socket whose address (and a watchdog interval) processes started
    meanwhile inherit from the environment."""
    ns = NotifySocket()
    monkeypatch.setenv("NOTIFY_SOCKET", ns.path)
    monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
    try:
        yield ns
    finally:
        ns.close()
