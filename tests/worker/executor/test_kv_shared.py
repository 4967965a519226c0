"""Buffers shared to another process (worker/executor/kv_shared.py): freed when the receiver
says it copied them, handed back when it could not open them, and freed after their
time when no answer comes, with the receiver's hold released each time it may remain."""

from __future__ import annotations

import gc
import weakref

from worker.executor.kv_shared import SharedBuffers


class Buffer:
    """Stands for a device buffer: what matters is whether anything still holds it."""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_copied_buffer_is_freed_without_releasing_the_receiver() -> None:
    shared, given_up = SharedBuffers(30.0), []
    buffer = Buffer()
    alive = weakref.ref(buffer)
    shared.keep(7, buffer, lambda: given_up.append(7))
    del buffer
    assert alive() is not None and len(shared) == 1
    assert shared.copied(7)
    gc.collect()
    assert alive() is None and len(shared) == 0
    assert given_up == []  # the receiver let go of it itself
    assert not shared.copied(7)  # a second answer finds nothing


def test_a_refused_buffer_comes_back_and_the_receivers_hold_is_released() -> None:
    shared, given_up = SharedBuffers(30.0), []
    buffer = Buffer()
    shared.keep(3, buffer, lambda: given_up.append(3))
    assert shared.refused(3) is buffer
    assert given_up == [3] and len(shared) == 0
    assert shared.refused(3) is None


def test_an_unanswered_buffer_is_freed_after_its_time() -> None:
    clock, given_up = Clock(), []
    shared = SharedBuffers(30.0, clock)
    first, second = Buffer(), Buffer()
    alive = weakref.ref(first)
    shared.keep(1, first, lambda: given_up.append(1))
    clock.now += 10.0
    shared.keep(2, second, lambda: given_up.append(2))
    del first
    clock.now += 19.9
    assert shared.expire() == [] and alive() is not None
    clock.now += 0.1
    assert shared.expire() == [1]
    gc.collect()
    assert alive() is None and given_up == [1] and len(shared) == 1
    assert not shared.copied(1)  # an answer after the time finds nothing
    clock.now += 10.0
    assert shared.expire() == [2] and given_up == [1, 2] and len(shared) == 0
