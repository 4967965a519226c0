"""ops.sd_notify: a notify socket whose reader has stopped reading never stalls the
sender; what does not fit is dropped, said once, and sending resumes when it drains."""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

import pytest

from ops.sd_notify import Notifier


@pytest.fixture
def unread_socket(tmp_path: Path):
    """A notify socket that nobody reads (until the test does)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    yield sock
    sock.close()


def test_a_full_queue_drops_messages_instead_of_blocking(unread_socket, tmp_path: Path, caplog) -> None:
    notifier = Notifier(address=str(tmp_path / "notify"), watchdog_usec="")
    sent = threading.Event()

    def send_many() -> None:
        for i in range(200):  # far more than a datagram queue holds (net.unix.max_dgram_qlen: 10)
            notifier.status(f"tick {i}")
        sent.set()

    with caplog.at_level(logging.WARNING, logger="ops.sd_notify"):
        threading.Thread(target=send_many, daemon=True).start()
        assert sent.wait(timeout=20), "a send blocked on the full queue"
    drops = [r for r in caplog.records if "queue is full" in r.getMessage()]
    assert len(drops) == 1, "one warning an outage, not one a message"

    # The reader catches up: the next message gets through, and a new outage is said again.
    unread_socket.setblocking(False)
    first = unread_socket.recv(4096)
    assert first == b"STATUS=tick 0"
    while True:
        try:
            unread_socket.recv(4096)
        except BlockingIOError:
            break
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ops.sd_notify"):
        notifier.status("caught up")
        assert unread_socket.recv(4096) == b"STATUS=caught up"
        for i in range(200):
            notifier.status(f"again {i}")
    assert sum("queue is full" in r.getMessage() for r in caplog.records) == 1
