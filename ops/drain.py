"""A service's drain on SIGTERM, the bookkeeping the worker and the gateway share:
the first SIGTERM drains (no new work; what is in flight gets up to a bound to
finish), a second ends the rest at once. The service's loop asks `begin` and
`cut` once a turn and does the rest: refusing, telling its peers, ending requests."""

from __future__ import annotations

import logging
import time

from ops.sd_notify import Notifier

log = logging.getLogger(__name__)


class Drain:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._requests = 0  # SIGTERMs so far, counted by a signal handler
        self._deadline: float | None = None

    def request(self) -> None:
        """From a signal handler: the first call drains, a second ends the rest at once."""
        self._requests += 1

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    def begin(self, in_flight: int, notifier: Notifier) -> bool:
        """True on the one loop turn that starts the drain: the caller stops taking work."""
        if not self._requests or self._deadline is not None:
            return False
        self._deadline = time.monotonic() + self.timeout_s
        log.info("draining: %d requests in flight get up to %.1f s to finish", in_flight, self.timeout_s)
        notifier.stopping(f"draining: {in_flight} requests in flight, {self.timeout_s:g} s bound")
        return True

    def cut(self) -> str | None:
        """Why the requests still in flight must end now (a second SIGTERM, or the bound
        passed), or None while they may run on."""
        assert self._deadline is not None, "cut() before begin()"
        if self._requests >= 2:
            return "a second SIGTERM"
        if time.monotonic() >= self._deadline:
            return f"its {self.timeout_s:g} s bound passed"
        return None
