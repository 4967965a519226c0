"""Logs: one event per line, readable in journald and by machines.

`text` (the default) is the familiar line, with the event's fields after it as
key=value and a traceback folded onto the same line; under journald
($JOURNAL_STREAM set) the timestamp is left to the journal and the line starts
with its syslog priority (<3> error ... <7> debug), so `journalctl -p warning`
works. `json` is one JSON object per line. Fields come from `extra=` (e.g.
request_id) on the logging call.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

FORMATS = ("text", "json")
# Every attribute a bare LogRecord has: anything else on a record came from `extra=`.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


def _quote(value: Any) -> str:
    text = str(value)
    if text and not any(c in text for c in ' "=\n'):
        return text
    return json.dumps(text, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self, kind: str, journald: bool) -> None:
        super().__init__()
        self.kind = kind
        self.journald = journald

    def format(self, record: logging.LogRecord) -> str:
        line = f"{self.kind} {record.levelname} {record.name}: {record.getMessage()}"
        extra = fields(record)
        if extra:
            line += " " + " ".join(f"{k}={_quote(v)}" for k, v in extra.items())
        if record.exc_info:
            line += " | " + self.formatException(record.exc_info).replace("\n", " | ")
        if self.journald:
            return f"<{_PRIORITY.get(record.levelno, 6)}>{line}"
        return f"{self.formatTime(record)} {line}"


class JsonFormatter(logging.Formatter):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def format(self, record: logging.LogRecord) -> str:
        event: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "process": self.kind,
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
            **fields(record),
        }
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        return json.dumps(event, ensure_ascii=False, default=str)


def setup_logging(kind: str, level: str, fmt: str = "text") -> None:
    """Configure the root logger of a service process (`kind`: worker, gateway, ...)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    journald = bool(os.environ.get("JOURNAL_STREAM"))
    handler.setFormatter(JsonFormatter(kind) if fmt == "json" else TextFormatter(kind, journald))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
