"""Buffers lent to another process (worker/executor/kv_lent.py): freed when the borrower
says it copied them, handed back when it could not open them, and freed after their
time when no answer comes, with the borrower's hold released each time it may remain."""

from __future__ import annotations

import gc
import weakref

from worker.executor.kv_lent import LentBuffers


class Buffer:
    """Stands for a device buffer: what matters is whether anything still holds it."""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_copied_buffer_is_freed_without_releasing_the_borrower() -> None:
    lent, given_up = LentBuffers(30.0), []
    buffer = Buffer()
    alive = weakref.ref(buffer)
    lent.lend(7, buffer, lambda: given_up.append(7))
    del buffer
    assert alive() is not None and len(lent) == 1
    assert lent.copied(7)
    gc.collect()
    assert alive() is None and len(lent) == 0
    assert given_up == []  # the borrower let go of it itself
    assert not lent.copied(7)  # a second answer finds nothing


def test_a_refused_buffer_comes_back_and_the_borrowers_hold_is_released() -> None:
    lent, given_up = LentBuffers(30.0), []
    buffer = Buffer()
    lent.lend(3, buffer, lambda: given_up.append(3))
    assert lent.refused(3) is buffer
    assert given_up == [3] and len(lent) == 0
    assert lent.refused(3) is None


def test_an_unanswered_buffer_is_freed_after_its_time() -> None:
    clock, given_up = Clock(), []
    lent = LentBuffers(30.0, clock)
    first, second = Buffer(), Buffer()
    alive = weakref.ref(first)
    lent.lend(1, first, lambda: given_up.append(1))
    clock.now += 10.0
    lent.lend(2, second, lambda: given_up.append(2))
    del first
    clock.now += 19.9
    assert lent.expire() == [] and alive() is not None
    clock.now += 0.1
    assert lent.expire() == [1]
    gc.collect()
    assert alive() is None and given_up == [1] and len(lent) == 1
    assert not lent.copied(1)  # an answer after the time finds nothing
    clock.now += 10.0
    assert lent.expire() == [2] and given_up == [1, 2] and len(lent) == 0
