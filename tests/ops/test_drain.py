"""ops.drain: one SIGTERM drains until its bound, a second cuts the drain short."""

from __future__ import annotations

import time

from ops.drain import Drain
from ops.sd_notify import Notifier


def test_the_first_request_begins_once_and_the_bound_cuts_it() -> None:
    drain = Drain(timeout_s=0.2)
    quiet = Notifier(address="")
    assert not drain.begin(3, quiet) and not drain.draining  # nothing asked yet
    drain.request()
    assert drain.begin(3, quiet) and drain.draining
    assert not drain.begin(3, quiet)  # once
    assert drain.cut() is None
    time.sleep(0.25)
    assert drain.cut() == "its 0.2 s bound passed"


def test_a_second_request_cuts_at_once() -> None:
    drain = Drain(timeout_s=60.0)
    drain.request()
    assert drain.begin(1, Notifier(address=""))
    assert drain.cut() is None
    drain.request()
    assert drain.cut() == "a second SIGTERM"
