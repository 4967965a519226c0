"""A real gateway process under a NOTIFY_SOCKET of the test's own: no READY while
Redis is unreachable, READY once it is reached, WATCHDOG pings from its socket
loop, STOPPING on SIGTERM, exit 0."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.notify import NotifySocket, notify_socket
from tests.procs import Gateway


@pytest.fixture
def notify(monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    with notify_socket(monkeypatch) as ns:
        yield ns


def test_ready_only_once_redis_is_reached(notify, redis_server_factory, tmp_path):
    server = redis_server_factory()
    server.stop()  # its port is kept: started again below, at the same URL
    gateway = Gateway("gw", server.url, tmp_path)
    try:
        gateway.wait_log("listening at", timeout=30)
        while (fields := notify.receive(timeout=1.5)) is not None:
            assert "READY" not in fields, "READY while Redis is down"
        assert gateway.alive
        server.start()
        ready = notify.wait_for("READY", timeout=15)
        assert ready["STATUS"].startswith("gateway gw listening at")
        notify.wait_for("WATCHDOG", timeout=5)
        notify.wait_for("WATCHDOG", timeout=5)
        gateway.process.send_signal(signal.SIGTERM)
        notify.wait_for("STOPPING", timeout=10)
        assert gateway.process.wait(timeout=15) == 0
    finally:
        gateway.stop()
