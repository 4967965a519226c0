"""What the worker logs of the requests that end (worker/service/ended_log.py)."""

from __future__ import annotations

import logging
import time

from worker.service.ended_log import EndedLog


def test_one_summary_per_interval_each_request_at_debug_errors_at_info(caplog):
    ended = EndedLog(interval_s=10.0)
    caplog.set_level(logging.INFO, logger="worker.service.ended_log")
    for i in range(3):
        ended.ended(f"r{i}", {"finish_reason": "length", "e2e_ms": "1.0"})
    ended.ended("r-stop", {"finish_reason": "stop"})
    ended.ended("r-bad", {"finish_reason": "error", "error": "boom"})
    assert [r.getMessage() for r in caplog.records] == ["request r-bad ended: error"]
    assert caplog.records[0].error == "boom"  # its stats as the line's fields

    start = ended._since
    ended.summarize(start + 5.0)  # within the interval: nothing yet
    assert len(caplog.records) == 1
    ended.summarize(start + 10.0)
    summary = caplog.records[-1]
    assert summary.levelno == logging.INFO
    assert summary.getMessage() == "5 requests ended in 10.0 s: 3 length, 1 stop, 1 error"
    assert summary.requests_ended == 5
    ended.summarize(start + 30.0, force=True)  # none ended since: no line
    assert len(caplog.records) == 2


def test_each_request_is_logged_at_debug(caplog):
    ended = EndedLog()
    caplog.set_level(logging.DEBUG, logger="worker.service.ended_log")
    ended.ended("r1", {"finish_reason": "stop", "output_tokens": "7"})
    ended.summarize(time.monotonic(), force=True)
    line, summary = caplog.records
    assert (line.levelno, line.getMessage(), line.output_tokens) == (logging.DEBUG, "request r1 ended: stop", "7")
    assert summary.getMessage().startswith("1 request ended in ")
