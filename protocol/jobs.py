"""Job queue records: what a queued job holds and what a finished one leaves.

Both are stored in Redis as msgpack maps (`pack` / `unpack_*`), not sent as
ZeroMQ messages, so they carry no envelope kind.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, TypeVar

import msgpack
from pydantic import Field, ValidationError

from protocol.base import Name, WireModel
from protocol.errors import ProtocolError
from protocol.packed import WIRE_CONTEXT, Floats, TokenIds
from protocol.request import Submit
from protocol.results import FunctionCall

T = TypeVar("T", bound=WireModel)


DEFAULT_RESULT_TTL_S = 7 * 24 * 3600


class JobStatus(enum.StrEnum):
    QUEUED = "queued"  # in the stream, or waiting for a retry after a failed delivery
    RUNNING = "running"  # a consumer submitted it to a gateway
    DONE = "done"
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # its deadline passed before it finished
    DEAD = "dead"  # failed on too many deliveries; a copy is in the dead-letter stream

    @property
    def terminal(self) -> bool:
        return self not in (JobStatus.QUEUED, JobStatus.RUNNING)


class Job(WireModel):
    """A queued job: one request (a generation, or an embedding); its request_id is the job id."""

    submit: Submit
    deadline: float | None = None  # unix time; past it the job ends EXPIRED
    submitted_at: float
    result_ttl_s: int = Field(DEFAULT_RESULT_TTL_S, ge=1)  # how long the result stays in Redis

    @property
    def job_id(self) -> str:
        return self.submit.request_id


class JobOutput(WireModel):
    text: str = ""
    token_ids: TokenIds = Field(default_factory=list)
    finish_reason: Annotated[str, Field(max_length=32)] | None = None
    tool_calls: list[FunctionCall] | None = None  # a chat given tools: the calls it made
    embedding: Floats | None = None  # an embedding job's only output: [hidden], unit length


class JobResult(WireModel):
    job_id: Name
    status: JobStatus = Field(strict=False)
    outputs: list[JobOutput] = Field(default_factory=list)
    error: str | None = None
    deliveries: int = Field(0, ge=0)
    submitted_at: float | None = None
    finished_at: float


def pack(record: Job | JobResult) -> bytes:
    data: bytes = msgpack.packb(record.model_dump(context=WIRE_CONTEXT, exclude_defaults=True), use_bin_type=True)
    return data


def unpack_job(data: bytes) -> Job:
    return _unpack(Job, data)


def unpack_result(data: bytes) -> JobResult:
    return _unpack(JobResult, data)


def _unpack(cls: type[T], data: bytes) -> T:
    try:
        raw: Any = msgpack.unpackb(data, raw=False)
        return cls.model_validate(raw)
    except (ValueError, ValidationError, msgpack.UnpackException) as e:
        raise ProtocolError(f"stored {cls.__name__} record is unreadable: {e}") from None
