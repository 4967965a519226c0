"""Where a request stands: why a sequence finished, and the state a request is
in. Defined once here for the executor, the wire and every API; standard
library only, so the executor imports it on a host without pydantic."""

from __future__ import annotations

import enum


class FinishReason(enum.IntEnum):
    """Why a sequence stopped, with TensorRT-LLM's values (they travel as ints)."""

    NOT_FINISHED = 0
    END_ID = 1
    STOP_WORDS = 2
    LENGTH = 3
    TIMED_OUT = 4
    CANCELLED = 5


class RequestState(enum.Enum):
    QUEUED = "queued"
    CONTEXT = "context"
    GENERATION = "generation"
    PREEMPTED = "preempted"
    FINISHED = "finished"
