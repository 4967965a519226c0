"""`tokenwire stats --watch` redraws the live view until Ctrl-C, with each worker's
throughput from its iteration stats."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from clients.client import Client
from tests.procs import CLIENT_OPTIONS, REPO, stack


def test_stats_watch_redraws_until_interrupted(service_model, redis_url, tmp_path):
    with stack(service_model, redis_url, tmp_path) as s:
        with Client([s.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
            client.generate([5, 6, 7], max_tokens=16, min_tokens=16, timeout=30)
        watch = subprocess.Popen(
            [sys.executable, "-m", "clients.cli", "stats", "--watch", "0.3", "--redis", redis_url],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        time.sleep(1.5)
        watch.send_signal(signal.SIGINT)
        out, _ = watch.communicate(timeout=10)
    assert watch.returncode == 0, out
    frames = out.split("tokenwire stats at ")[1:]
    assert len(frames) >= 2, out
    last = frames[-1]
    assert "worker0" in last and "free KV blocks" in last
    assert "tokens/s scheduled" in last
    row = next(line for line in last.splitlines() if line.startswith("worker0") and len(line.split()) == 3)
    assert float(row.split()[2]) > 0  # the 3 prompt tokens and 16 generated, within the window
