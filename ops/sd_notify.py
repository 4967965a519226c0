"""The systemd notify protocol, spoken directly: one datagram per message to the
AF_UNIX socket named by $NOTIFY_SOCKET (an abstract socket when it starts with
'@'). Without $NOTIFY_SOCKET (not under systemd) every call does nothing.

Sends never wait: a datagram socket's queue holds few messages (Linux's
net.unix.max_dgram_qlen, 10 by default), and a reader that falls behind (or stops
reading, as `tokenwire up` once did after start-up) would otherwise stall the loop
that sends, which is the service's main loop. A message that finds the queue full
is dropped; STATUS and WATCHDOG are sent again soon anyway.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, address: str | None = None, watchdog_usec: str | None = None) -> None:
        address = os.environ.get("NOTIFY_SOCKET") if address is None else address
        self._address: str | bytes | None = None
        self._sock: socket.socket | None = None
        if address:
            self._address = b"\0" + address[1:].encode() if address.startswith("@") else address
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        usec = os.environ.get("WATCHDOG_USEC") if watchdog_usec is None else watchdog_usec
        # systemd's advice: ping at half the timeout. Without a watchdog, still ping
        # now and then, so a manager that enables one later is served.
        self.watchdog_interval_s = int(usec) / 2e6 if usec else 5.0
        self._last_ping = 0.0
        self._ready = False
        self._lock = threading.Lock()
        self._dropping = False  # since the last message that got through

    def notify(self, *fields: str) -> None:
        """Send 'KEY=value' fields as one message; a failure is logged, never raised
        (losing a notification must not take the service down)."""
        if self._sock is None or self._address is None:
            return
        message = "\n".join(fields).encode()
        try:
            with self._lock:
                self._sock.sendto(message, socket.MSG_DONTWAIT, self._address)
                self._dropping = False
        except BlockingIOError:
            if not self._dropping:  # once an outage, not on every tick
                self._dropping = True
                log.warning("sd_notify: the notify socket's queue is full (its reader is behind): dropping %r "
                            "and what follows until it drains", fields)  # fmt: skip
        except OSError as e:
            log.warning("sd_notify: could not send %r: %s", fields, e)

    def ready(self, status: str) -> None:
        self._ready = True
        self.notify("READY=1", f"STATUS={_one_line(status)}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={_one_line(status)}")

    def stopping(self, status: str) -> None:
        self.notify("STOPPING=1", f"STATUS={_one_line(status)}")

    def watchdog(self) -> None:
        """Call as often as you like from the loop whose liveness it proves: it
        sends at most one WATCHDOG=1 per interval, and none before READY=1 (systemd
        arms the watchdog once start-up is complete)."""
        if self._sock is None or not self._ready:
            return
        now = time.monotonic()
        if now - self._last_ping >= self.watchdog_interval_s:
            self._last_ping = now
            self.notify("WATCHDOG=1")


def _one_line(text: str) -> str:
    return " ".join(text.split())
