"""When a streamed request's tokens arrive: its TTFT and inter-token gaps, and percentiles of them."""

from __future__ import annotations


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


class Timeline:
    """Arrival times of one request's tokens: TTFT and inter-token gaps (a message
    carrying k tokens counts as k gaps of a k-th of its wait each)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.last: float | None = None
        self.ttft: float | None = None
        self.gaps: list[tuple[float, float]] = []  # (when the gap began, its length)
        self.tokens = 0

    def add(self, now: float, n: int) -> None:
        if n == 0:
            return
        if self.last is None:
            self.ttft = now - self.start
        else:
            self.gaps.extend([(self.last, (now - self.last) / n)] * n)
        self.last = now
        self.tokens += n
