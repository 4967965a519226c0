"""How many threads a service process's math libraries may run.

OpenBLAS (numpy's matrix products) and torch start one thread per core and spin while
they wait for each other. Beside other busy processes on the same cores (the worker's
own I/O thread, a gateway, a load generator) a spinning thread that loses its core
stalls every product it takes part in: on a 2-core host with a client using most of a
core, the numpy worker served a tenth of the tokens per second it served with one BLAS
thread. So a worker leaves one of the cores it may use to the others unless told
otherwise (`--cpu-threads`). threadpoolctl sets the limit in whichever BLAS and OpenMP
libraries are loaded, whatever their vendor, which no environment variable does once
they have started.
"""

from __future__ import annotations

import os
import sys

from threadpoolctl import threadpool_info, threadpool_limits


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as cgroups and taskset set it)."""
    return len(os.sched_getaffinity(0))


def default_compute_threads() -> int:
    """All usable cores but one, left to the processes beside the engine; at least one."""
    return max(1, usable_cores() - 1)


def limit_compute_threads(threads: int | None) -> int:
    """Limit the loaded BLAS / OpenMP libraries and torch's intra-op pool to `threads`
    (None: `default_compute_threads()`). Call it once the backend is loaded: libraries
    loaded later keep their own default. Returns the limit the libraries now report."""
    n = default_compute_threads() if threads is None else threads
    threadpool_limits(limits=n)
    if "torch" in sys.modules:  # the torch backend; importing torch only to limit it would cost seconds
        sys.modules["torch"].set_num_threads(n)
    return max((pool["num_threads"] for pool in threadpool_info()), default=n)
