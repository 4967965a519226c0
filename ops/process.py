"""Process-wide rules for a service under systemd."""

from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)


def exit_on_thread_crash() -> None:
    """An exception that ends any thread ends the process with status 1.

    A service's threads (I/O, result pump, Redis, executor loop) are all needed;
    one dying silently would leave a process that looks alive but is not whole.
    Exiting non-zero lets systemd's Restart=on-failure bring up a whole one.
    """

    def crash(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        log.critical(
            "thread %s died: %s: %s; exiting", name, args.exc_type.__name__, args.exc_value,
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback),  # type: ignore[arg-type]
        )  # fmt: skip
        logging.shutdown()
        os._exit(1)

    threading.excepthook = crash


_PR_SET_PDEATHSIG = 1


def follow_parent(parent: int) -> None:
    """What a child process that serves `parent` does first (the engine process, the
    model ranks): leave stopping to the parent (a terminal's Ctrl-C, or a supervisor's
    SIGTERM, reaches the whole process group, and the parent drains first), and get
    SIGKILL when the parent ends, however it ends (Linux's PR_SET_PDEATHSIG; the kernel
    watches the thread that started the child: start it from the main thread). A child
    that waits on its parent's pipe notices the parent's end by itself, but not one stuck
    elsewhere: in a CUDA call, an NCCL collective or a hung loop, it would live on
    holding the device."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _signal_when_parent_ends(signal.SIGKILL)
    if os.getppid() != parent:  # the parent ended before the kernel was asked
        os._exit(1)


# `tokenwire up` puts its pid here in its children's environment.
LAUNCHER_ENV = "TOKENWIRE_LAUNCHER_PID"


def stop_with_launcher() -> None:
    """A service that `tokenwire up` started gets SIGTERM when `up` ends, however it ends
    (kill -9, a crash), and stops as it does on a supervisor's SIGTERM (drains,
    deregisters); else it would serve on with no one left to stop it, holding its ports
    and its GPU. Called from the main thread before loading; a process that finds `up`
    already gone exits 1. Outside `up` (systemd, a shell) the variable is absent and
    nothing changes. The variable is removed, so that this process's own children (the
    engine, the model ranks) do not take it for theirs: they follow this one."""
    launcher = os.environ.pop(LAUNCHER_ENV, "")
    if not launcher.isdigit():
        return
    _signal_when_parent_ends(signal.SIGTERM)
    if os.getppid() != int(launcher):
        log.critical("tokenwire up (pid %s), which started this process, has ended; exiting", launcher)
        raise SystemExit(1)


def _signal_when_parent_ends(sig: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        log.warning("PR_SET_PDEATHSIG is not available: this process may outlive its parent")


# Net new container objects between young-generation collections (CPython: 700, a
# few streamed steps' worth of lists and responses in a worker).
GC_YOUNG_THRESHOLD = 20_000


def settle_gc() -> None:
    """Keep the cyclic garbage collector off a serving process's hot path; call it
    once loading is done.

    Everything alive then (modules, the model, the tokenizer) is frozen out of later
    collections: without that, each full collection walks the whole heap, and in a
    worker those took up to 100 ms, every stream's tokens waiting behind them. Young
    collections run every GC_YOUNG_THRESHOLD allocations instead of 700. Reference
    counting still frees almost everything at once; the collector only finds cycles.

    At exit the frozen heap goes back to the collector, so that interpreter shutdown
    frees its cycles as usual: left frozen, they outlive their extension modules, and
    Triton's bindings (nanobind, Triton 3.9) then print a "leaked instances" report
    of some 40 lines to stderr, into the journal of every stopped worker.
    """
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def children(pid: int) -> list[int]:
    """The processes that `pid`'s main thread started and that are still its children (Linux)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def spawned(pid: int) -> list[int]:
    """Those of `pid`'s children started with multiprocessing's spawn (not its resource tracker):
    a worker's engine process."""
    return [c for c in children(pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def stop_children(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    """SIGTERM each running child, the last started first (the gateway before the
    worker it talks to), then wait for each; SIGKILL what outlives `timeout_s`."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.terminate()
    for proc in reversed(procs):
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
