"""What the worker logs of the requests that end.

A line for each request was a quarter of a busy worker's CPU on short requests, and
at thousands of requests a second nobody reads it; each request's record is in Redis
(`tokenwire stats`) and its counts in /metrics. So: one INFO line per interval saying
how many requests ended and how; each request's own line (with its stats as fields)
at DEBUG, except a request that ended with an error, whose line stays at INFO.
"""

from __future__ import annotations

import collections
import logging
import time

log = logging.getLogger(__name__)

SUMMARY_INTERVAL_S = 10.0


class EndedLog:
    """Counts the requests that end, by how, and logs them; one thread's (the result pump's)."""

    def __init__(self, interval_s: float = SUMMARY_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._counts: collections.Counter[str] = collections.Counter()
        self._since = time.monotonic()

    def ended(self, name: str, fields: dict[str, str]) -> None:
        """Request `name` ended; `fields`: its stats record, `finish_reason` among them."""
        how = fields["finish_reason"]
        if not self._counts:
            self._since = time.monotonic()  # the summary covers from the first request it counts
        self._counts[how] += 1
        if how == "error":
            log.info("request %s ended: %s", name, how, extra=fields)
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("request %s ended: %s", name, how, extra=fields)

    def summarize(self, now: float, force: bool = False) -> None:
        """The summary line, once `interval_s` passed since the first request it counts
        ended (or when `force`), if any did."""
        if not self._counts or (now - self._since < self.interval_s and not force):
            return
        total = sum(self._counts.values())
        how = ", ".join(f"{n} {reason}" for reason, n in self._counts.most_common())
        log.info("%d request%s ended in %.1f s: %s", total, "" if total == 1 else "s", now - self._since, how,
                 extra={"requests_ended": total})  # fmt: skip
        self._counts.clear()
        self._since = now
