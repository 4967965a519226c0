"""`tokenwire keys ...` as a subprocess, for the tests of API keys and their limits."""

from __future__ import annotations

import subprocess
import sys

from tests.procs import REPO


def tokenwire(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clients.cli", "keys", *args, "--redis", redis_url],
                          cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
