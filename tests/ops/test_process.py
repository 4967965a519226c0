"""ops.process: a thread dying of an exception ends the process non-zero (so that
systemd restarts it), with the reason in the log."""

from __future__ import annotations

import subprocess
import sys

from tests.procs import REPO

SCRIPT = """
import logging, threading, time
from ops.process import exit_on_thread_crash
logging.basicConfig(level="INFO")
exit_on_thread_crash()
def die():
    raise RuntimeError("the pump broke")
threading.Thread(target=die, name="worker-pump", daemon=True).start()
time.sleep(30)
print("still alive")
"""


def test_a_crashed_thread_ends_the_process_with_status_1() -> None:
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=20, check=False
    )
    assert run.returncode == 1
    assert "still alive" not in run.stdout
    assert "thread worker-pump died: RuntimeError: the pump broke; exiting" in run.stderr
