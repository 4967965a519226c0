"""ops.process: a thread dying of an exception ends the process non-zero (so that
systemd restarts it), with the reason in the log; settle_gc keeps the loaded heap
out of the collector's way, and hands it back at exit; follow_parent ends a child
whose parent is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import REPO, running

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


SETTLE_SCRIPT = """
import gc
from ops.process import GC_YOUNG_THRESHOLD, settle_gc
loaded = [[i] for i in range(10_000)]  # what a worker holds once loaded
settle_gc()
assert gc.get_freeze_count() >= len(loaded), gc.get_freeze_count()
assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD
before = gc.get_count()[0]
made = [[i] for i in range(1000)]  # 1000 new containers: no young collection yet
assert gc.get_count()[0] >= before + 1000, (before, gc.get_count())
print("settled")
"""


def test_settle_gc_freezes_what_is_loaded_and_collects_young_objects_less_often() -> None:
    # In a child: freezing is process-wide, and this test process must keep its own collector.
    run = subprocess.run(
        [sys.executable, "-c", SETTLE_SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=20, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "settled"


UNFREEZE_SCRIPT = """
import os
from ops.process import settle_gc
class Cycle:
    def __init__(self):
        self.me = self
    def __del__(self, write=os.write):
        write(1, b"collected")
held = Cycle()  # loaded, so frozen
settle_gc()
del held  # garbage now, but only a collection outside the frozen heap can free it
"""


def test_settle_gc_hands_the_frozen_heap_back_to_the_collector_at_exit() -> None:
    run = subprocess.run(
        [sys.executable, "-c", UNFREEZE_SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=20, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "collected"


def test_a_settled_process_that_loaded_triton_exits_without_a_leak_report() -> None:
    # The engine process of a torch-backend worker: Triton's nanobind bindings report
    # every instance still alive when they are torn down.
    pytest.importorskip("triton.language")
    script = "import triton.language\nfrom ops.process import settle_gc\nsettle_gc()\n"
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stderr
    assert "leaked" not in run.stderr, run.stderr


# A parent that starts a child which blocks without reading anything, prints the
# child's pid, and waits to be killed.
PARENT_SCRIPT = """
import multiprocessing, os, sys, time

def child(parent, follow):
    if follow:
        from ops.process import follow_parent
        follow_parent(parent)
    time.sleep(600)

if __name__ == "__main__":
    p = multiprocessing.get_context("spawn").Process(target=child, args=(os.getpid(), sys.argv[1] == "follow"))
    p.start()
    print(p.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("follow", [True, False], ids=["follow_parent", "without"])
def test_follow_parent_ends_a_stuck_child_when_its_parent_is_killed(tmp_path: Path, follow: bool) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, str(script), "follow" if follow else "no"], env=env,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        assert running(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + (5 if follow else 1)
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Without it, the child lives on: the test tells the two apart.
        assert running(child) is not follow
    finally:
        if running(child):
            os.kill(child, signal.SIGKILL)


def test_a_service_whose_launcher_has_ended_exits_at_once_and_hides_the_launcher_from_its_children() -> None:
    code = (
        "import logging, os; logging.basicConfig(level='INFO')\n"
        "from ops.process import LAUNCHER_ENV, stop_with_launcher\n"
        "stop_with_launcher()\n"
        "print('served on', os.environ.get(LAUNCHER_ENV))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for launcher, served in ((os.getpid(), True), (1, False)):  # its parent; a process that is not
        done = subprocess.run([sys.executable, "-c", code], env={**env, "TOKENWIRE_LAUNCHER_PID": str(launcher)},
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        if served:
            assert done.returncode == 0 and done.stdout.strip() == "served on None", done
        else:
            assert done.returncode == 1 and "has ended; exiting" in done.stderr, done
            assert "Traceback" not in done.stderr
