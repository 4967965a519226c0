"""`tokenwire generate` and `tokenwire stats` against a running stack."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.procs import stack


def tokenwire(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("tokenwire", path=str(Path(sys.executable).parent))
    command = [exe] if exe else [sys.executable, "-m", "clients.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60, check=False)


def test_generate_and_stats(service_model, redis_url, tmp_path):
    with stack(service_model, redis_url, tmp_path) as s:
        gw = s.gateways[0].endpoint
        streamed = tokenwire("generate", "The quick brown fox", "--gateway", gw, "--stream",
                             "--max-tokens", "6", "--seed", "3", "--temperature", "0.7")  # fmt: skip
        assert streamed.returncode == 0, streamed.stderr
        assert "6 tokens, finish reason length" in streamed.stderr
        whole = tokenwire("generate", "The quick brown fox", "--gateway", gw,
                          "--max-tokens", "6", "--seed", "3", "--temperature", "0.7")  # fmt: skip
        assert whole.returncode == 0, whole.stderr
        assert whole.stdout == streamed.stdout  # same seed, same text, streamed or not

        bad = tokenwire("generate", "x", "--gateway", gw, "--max-tokens", "0")
        assert bad.returncode == 2
        assert "error: max_tokens" in bad.stderr
        assert "Traceback" not in bad.stderr

        stats = tokenwire("stats", "--redis", s.redis_url)
        assert stats.returncode == 0, stats.stderr
        assert "worker0" in stats.stdout
        assert s.workers[0].endpoint in stats.stdout
        assert "latency ms" in stats.stdout  # recent iterations are listed


def test_stats_without_redis_is_a_clear_error():
    done = tokenwire("stats", "--redis", "redis://127.0.0.1:1/0")
    assert done.returncode == 1
    assert "could not read Redis" in done.stderr
