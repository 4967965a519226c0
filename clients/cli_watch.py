"""`tokenwire stats --watch`: the stats view redrawn every few seconds, with each
worker's recent throughput (and draft acceptance, when it speculates) from its
iteration stats in Redis."""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from collections.abc import Callable
from typing import Any

from clients.cli_table import format_table

WINDOW_S = 10.0


def acceptance(drafted: int, accepted: int) -> str:
    """Accepted / drafted tokens of speculative decoding, as shown by `tokenwire stats`."""
    return f"{accepted}/{drafted} ({accepted / drafted:.0%})" if drafted else "-"


def with_acceptance(header: list[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """The table with its last column, acceptance, only when some worker speculated."""
    if any(row[-1] != "-" for row in rows):
        return [*header, "drafts accepted"], rows
    return header, [row[:-1] for row in rows]


def throughput(r: Any, prefix: str) -> list[list[str]]:
    """Per live worker: iterations/s, scheduled tokens/s and draft tokens accepted
    over the last WINDOW_S."""
    import protocol

    keys = protocol.Keys(prefix)
    now = time.time()
    rows = []
    for raw in r.zrange(keys.workers(), 0, -1):
        worker_id = raw.decode()
        iterations = tokens = drafted = accepted = 0
        for _, fields in r.xrevrange(keys.iteration_stats(worker_id), count=10_000):
            if float(fields[b"timestamp"]) < now - WINDOW_S:
                break
            iterations += 1
            tokens += int(fields[b"num_scheduled_tokens"])
            drafted += int(fields.get(b"num_draft_tokens", 0))
            accepted += int(fields.get(b"num_accepted_draft_tokens", 0))
        rows.append([worker_id, f"{iterations / WINDOW_S:.1f}", f"{tokens / WINDOW_S:.1f}",
                     acceptance(drafted, accepted)])
    return rows


def watch(args: argparse.Namespace, show: Callable[[argparse.Namespace], int]) -> int:
    import redis

    once = argparse.Namespace(**{**vars(args), "watch": None})
    r: Any = redis.Redis.from_url(args.redis, socket_timeout=5)
    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
    try:
        while True:
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                show(once)
                try:
                    rows = throughput(r, args.redis_prefix)
                except redis.RedisError:
                    rows = []
                if rows:
                    print()
                    print(format_table(*with_acceptance(
                        ["worker", f"iterations/s ({WINDOW_S:g} s)", "tokens/s scheduled"], rows)))
            stamp = time.strftime("%H:%M:%S")
            sys.stdout.write(f"{clear}tokenwire stats at {stamp}, every {args.watch:g} s; Ctrl-C quits\n\n")
            sys.stdout.write(out.getvalue() + "\n")
            sys.stdout.flush()
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        r.close()
