"""CPU time per process, for a bench's table: where a streamed token's host work is spent."""

from __future__ import annotations

import os
import resource
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used (all its threads), from /proc (Linux;
    NaN elsewhere, or once it has gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime: fields 14 and 15 of stat(5)


def own_cpu_seconds() -> float:
    """This process's (the bench's: its client or its in-process engine)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
