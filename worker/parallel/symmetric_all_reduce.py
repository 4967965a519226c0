"""The tensor-parallel all-reduce of activations on CUDA: NCCL's, or one through
symmetric memory, whichever a measurement at start found faster for the size.

NCCL's ring all-reduce of a step's activations is bound by its protocol's latency and
step count, not by the link: on two H200s (NVLink) 512 x 8192 bf16 took 48.7 us (172
GB/s), and a decode step of a 70B model runs 160 of them, 12 % of the step. Symmetric
memory (torch.distributed._symmetric_memory) gives every rank of the group a view of
each other's buffer over NVLink; torch's kernels over it sum the peers' buffers in one
pass (one-shot), or sum a share each and write it to the peers (two-shot). Which of the
three is fastest depends on the size and the link, so the group times all three at
start, in CUDA graphs as the decode steps run them, over a ladder of row counts; each
rung takes the method whose slowest rank was fastest (every rank must pick the same,
or the collectives would not meet). A method that fails to set up, to capture or to
sum right is dropped, and NCCL serves alone. torch ships the kernels but not this
choice, which is why it is written here. On the two H200s two-shot took 41.2 us at 512
rows and 17.2 at 128 (NCCL 48.4 and 29.9); NCCL stayed fastest from 4096 rows.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Row counts of [rows, hidden] activations that the start-up measurement times; a size
# between two rungs takes the larger rung's method.
RUNGS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_REPS = 20  # all-reduces per timed graph


class ActivationAllReduce:
    """In-place sums of [rows, hidden] activations over a tensor-parallel group (CUDA)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, dtype: torch.dtype, hidden: int,
                 max_rows: int) -> None:  # fmt: skip
        """Collective: every rank of `group` (None: the default group) constructs it at
        the same point. Sets up symmetric buffers for `max_rows` rows and measures."""
        self.group = group
        self.hidden = hidden
        self.dtype = dtype
        self.rungs = [r for r in RUNGS if r < max_rows] + [max_rows]
        self.choice = ["nccl"] * len(self.rungs)  # each rung's method, by name (self._methods)
        self._methods: dict[str, Callable[[torch.Tensor], None]] = {
            "nccl": self._nccl, "one-shot": self._one_shot, "two-shot": self._two_shot,
        }  # fmt: skip
        self.timings: dict[str, list[float]] = {}
        self._buffer: torch.Tensor | None = None
        self._group_name = ""
        try:
            self._set_up_symmetric(device, max_rows)
            self._choose(device)
        except Exception as e:  # no symmetric memory here: NCCL serves every size
            log.warning("symmetric-memory all-reduce unavailable (%s: %s); NCCL serves every size",
                        type(e).__name__, e)  # fmt: skip
            self._buffer = None
            self.choice = ["nccl"] * len(self.rungs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place."""
        if x.dtype != self.dtype or not x.is_contiguous() or x.numel() % self.hidden:
            self._nccl(x)
            return x
        i = bisect.bisect_left(self.rungs, x.numel() // self.hidden)
        self._methods[self.choice[i] if i < len(self.rungs) else "nccl"](x)
        return x

    def describe(self) -> str:
        """Which method serves which rows, e.g. on two H200s at 8192 hidden 'rows <= 16:
        one-shot; rows <= 2048: two-shot; rows <= 8192: nccl'."""
        spans, start = [], 0
        for i in range(1, len(self.rungs) + 1):
            if i == len(self.rungs) or self.choice[i] != self.choice[start]:
                spans.append(f"rows <= {self.rungs[i - 1]}: {self.choice[start]}")
                start = i
        return "; ".join(spans)

    # -- the methods --------------------------------------------------------------------

    def _nccl(self, x: torch.Tensor) -> None:
        dist.all_reduce(x, group=self.group)

    def _one_shot(self, x: torch.Tensor) -> None:
        flat, staged = self._stage(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self._group_name, flat)

    def _two_shot(self, x: torch.Tensor) -> None:
        flat, staged = self._stage(x)
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self._group_name)
        flat.copy_(staged)

    def _stage(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x flat, and a copy of it in this rank's symmetric buffer (the kernels read there)."""
        flat = x.view(-1)
        assert self._buffer is not None
        staged = self._buffer[: flat.numel()]
        staged.copy_(flat)
        return flat, staged

    # -- start-up -----------------------------------------------------------------------

    def _set_up_symmetric(self, device: torch.device, max_rows: int) -> None:
        import warnings

        import torch.distributed._symmetric_memory as symm_mem

        group = self.group or dist.group.WORLD
        assert group is not None
        self._group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # older torch needs it; newer only warns
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(self._group_name)
        self._buffer = symm_mem.empty(max_rows * self.hidden, dtype=self.dtype, device=device)
        symm_mem.rendezvous(self._buffer, group)

    def _choose(self, device: torch.device) -> None:
        """Time every method at every rung (the slowest rank's time counts), check that
        the symmetric ones sum as NCCL does, and keep the fastest per rung."""
        usable = dict(self._methods)
        for name in ("one-shot", "two-shot"):
            ok = _agreed(self._sums_right(self._methods[name], device), self.group, device)
            if not ok:
                log.warning("symmetric-memory all-reduce: %s failed its check; not used", name)
                del usable[name]
        for name, method in usable.items():
            times = []
            for rows in self.rungs:
                x = torch.randn(rows, self.hidden, device=device, dtype=self.dtype)
                try:
                    times.append(_graph_time(method, x))
                except Exception as e:  # e.g. a size the kernel refuses: never chosen
                    log.warning("%s all-reduce of %d rows raised %s: %s", name, rows, type(e).__name__, e)
                    times.append(float("inf"))
            worst = torch.tensor(times, dtype=torch.float64, device=device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.group)
            self.timings[name] = worst.tolist()
        # Only usable methods were timed, so each rung's fastest is one of them.
        self.choice = [min(self.timings, key=lambda name: self.timings[name][i]) for i in range(len(self.rungs))]
        log.info("activation all-reduce: %s", self.describe())

    def _sums_right(self, method: Callable[[torch.Tensor], None], device: torch.device) -> bool:
        """Whether `method` gives NCCL's sums, run eagerly and replayed from a CUDA graph."""
        rows = min(self.rungs[-1], 64)
        try:
            gen = torch.Generator(device=device).manual_seed(dist.get_rank())  # each rank its own addend
            x = torch.randn(rows, self.hidden, device=device, dtype=self.dtype, generator=gen)
            want = x.clone()
            self._nccl(want)
            got = x.clone()
            method(got)
            graphed = x.clone()
            graph = _capture(lambda: method(graphed))
            graphed.copy_(x)  # the capture's warm-up summed it already
            graph.replay()
            torch.cuda.synchronize(device)
            tol = 1e-2 if self.dtype == torch.bfloat16 else 1e-5
            return all(torch.allclose(t, want, atol=tol, rtol=tol) for t in (got, graphed))
        except Exception as e:
            log.warning("symmetric-memory all-reduce check raised %s: %s", type(e).__name__, e)
            return False


def _agreed(ok: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True when every rank of the group says True."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _graph_time(method: Callable[[torch.Tensor], None], x: torch.Tensor) -> float:
    """Seconds per all-reduce of x: the median of 5 replays of a graph of _REPS of them."""

    def reps() -> None:
        for _ in range(_REPS):
            method(x)

    graph = _capture(reps)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / _REPS)
    return sorted(times)[2]
