"""`tokenwire jobs consume` under a NOTIFY_SOCKET of the test's own: READY once
Redis is reached, WATCHDOG from its loop, STOPPING on SIGTERM, exit 0."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.notify import NotifySocket, notify_socket
from tests.procs import REPO, free_port


@pytest.fixture
def notify(monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    with notify_socket(monkeypatch) as ns:
        yield ns


def test_consumer_notify_sequence(notify, redis_url, tmp_path):
    log = (tmp_path / "consumer.log").open("wb")
    consumer = subprocess.Popen(
        [sys.executable, "-m", "clients.cli", "jobs", "consume", "--redis", redis_url,
         "--gateway", f"tcp://127.0.0.1:{free_port()}", "--name", "c1"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        ready = notify.wait_for("READY", timeout=30)
        assert ready["STATUS"].startswith("consumer c1: Redis reached")
        notify.wait_for("WATCHDOG", timeout=5)
        notify.wait_for("WATCHDOG", timeout=5)
        consumer.send_signal(signal.SIGTERM)
        assert "STOPPING" in notify.wait_for("STOPPING", timeout=10)
        assert consumer.wait(timeout=20) == 0
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait()
        log.close()
    kinds = notify.kinds()
    assert kinds.index("READY") < kinds.index("WATCHDOG") < kinds.index("STOPPING")
