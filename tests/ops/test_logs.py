"""ops.logs: one line per event, fields from `extra=`, tracebacks folded in, JSON
that parses, journald priorities."""

from __future__ import annotations

import json
import logging

import pytest

from ops.logs import JsonFormatter, TextFormatter, setup_logging


def _record(exc: bool = False) -> logging.LogRecord:
    logger = logging.getLogger("tokenwire.test")
    exc_info = None
    if exc:
        try:
            raise ValueError("boom\nsecond line")
        except ValueError:
            import sys

            exc_info = sys.exc_info()
    return logger.makeRecord(
        "tokenwire.test", logging.WARNING, __file__, 1, "request %s ended", ("r-1",), exc_info,
        extra={"request_id": "r-1", "finish_reason": "length", "error": 'has "quotes" and spaces'},
    )  # fmt: skip


def test_text_is_one_line_with_fields_and_traceback() -> None:
    line = TextFormatter("worker", journald=False).format(_record(exc=True))
    assert "\n" not in line
    assert "worker WARNING tokenwire.test: request r-1 ended" in line
    assert "request_id=r-1 finish_reason=length" in line
    assert 'error="has \\"quotes\\" and spaces"' in line
    assert "ValueError: boom | second line" in line


def test_journald_lines_carry_the_priority_and_no_timestamp() -> None:
    line = TextFormatter("gateway", journald=True).format(_record())
    assert line.startswith("<4>gateway WARNING ")


def test_json_is_one_parsable_object_per_line() -> None:
    line = JsonFormatter("worker").format(_record(exc=True))
    assert "\n" not in line
    event = json.loads(line)
    assert event["level"] == "warning" and event["process"] == "worker"
    assert event["msg"] == "request r-1 ended" and event["request_id"] == "r-1"
    assert "boom" in event["exc"]


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log format 'xml'"):
        setup_logging("worker", "INFO", "xml")
