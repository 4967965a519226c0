"""Per-step host time of the engine core over an asynchronous backend (`--profile`).

Each step of the core runs on the host as: prepare (schedule, build the batch's
metadata), launch (upload, queue the kernels or replay a graph, queue sampling),
wait (read back the previous step's tokens: blocked until the GPU has finished
it), then hand out the results. The GPU runs step N while the host prepares and
launches step N+1; so when the wait is near zero, the GPU finished before the host
came to ask, and the host, not the GPU, set the step's pace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

# A wait shorter than this: the step's result was ready when the host asked for it.
READY_S = 50e-6


@dataclass(slots=True)
class StepTime:
    total: float
    prepare: float  # step start to launch
    launch: float
    wait: float  # blocked reading back earlier steps' results


class _TimedHandle:
    def __init__(self, inner: Any, waits: list[float]) -> None:
        self.inner, self.waits = inner, waits

    def result(self) -> Any:
        t0 = time.perf_counter()
        out = self.inner.result()
        self.waits.append(time.perf_counter() - t0)
        return out


class HostTimer:
    """Install on the backend before the EngineCore is made (the core binds its
    `launch`), then `attach` the core; `take()` returns and clears the steps so far."""

    def __init__(self, backend: Any) -> None:
        self._steps: list[StepTime] = []
        self._waits: list[float] = []
        self._launch_at: tuple[float, float] | None = None  # (started, ended)
        launch: Callable[..., Any] = backend.launch

        def timed_launch(batch: Any, sampling: Any) -> _TimedHandle:
            started = time.perf_counter()
            handle = launch(batch, sampling)
            self._launch_at = (started, time.perf_counter())
            return _TimedHandle(handle, self._waits)

        backend.launch = timed_launch

    def attach(self, core: Any) -> None:
        step: Callable[[], Any] = core.step

        def timed_step() -> Any:
            self._waits.clear()
            self._launch_at = None
            t0 = time.perf_counter()
            out = step()
            total = time.perf_counter() - t0
            if self._launch_at is not None:  # steps that launched nothing are idle turns
                started, ended = self._launch_at
                self._steps.append(StepTime(total, started - t0, ended - started, sum(self._waits)))
            return out

        core.step = timed_step

    def take(self) -> list[StepTime]:
        steps, self._steps = self._steps, []
        return steps


def summarize(steps: list[StepTime]) -> dict[str, float]:
    """Means in ms per step, and the share of steps whose result was ready when asked for
    (the host on the critical path)."""
    if not steps:
        return {}
    total = np.array([s.total for s in steps])
    wait = np.array([s.wait for s in steps])
    return {
        "step_ms": round(float(total.mean()) * 1e3, 3),
        "host_prepare_ms": round(float(np.mean([s.prepare for s in steps])) * 1e3, 3),
        "host_launch_ms": round(float(np.mean([s.launch for s in steps])) * 1e3, 3),
        "host_ms": round(float((total - wait).mean()) * 1e3, 3),
        "gpu_wait_ms": round(float(wait.mean()) * 1e3, 3),
        "host_bound_steps": round(float((wait < READY_S).mean()), 3),
    }
