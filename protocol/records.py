"""Records a worker publishes about itself: load (in heartbeats and result
batches), registry entry, and the executor's iteration and request stats."""

from __future__ import annotations

import time
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from protocol.base import Message, Name, WireModel

Count = Annotated[int, Field(ge=0)]
Millis = Annotated[float, Field(ge=0.0)]


class WorkerLoad(WireModel):
    num_queued_requests: Count = 0
    num_active_requests: Count = 0
    free_num_blocks: Count = 0
    max_num_blocks: Count = 0


class WorkerInfo(Message):
    """A worker's registry entry: where to connect and what it serves."""

    kind: ClassVar[str] = "worker_info"

    worker_id: Name
    address: Name  # ZeroMQ endpoint gateways connect to, e.g. tcp://10.0.0.5:5600
    models: list[Name] = Field(min_length=1)
    host: Name
    pid: int = Field(ge=1)
    device: Name | None = None  # e.g. "cuda:0", "cpu"
    started_at: float  # unix time
    max_batch_size: int | None = Field(None, ge=1)
    state: Literal["serving", "draining"] = "serving"
    curve_public_key: Name | None = None  # z85; a gateway with CURVE on connects only to pinned keys
    lora_adapters: list[Name] = Field(default_factory=list)  # the LoRA adapters it holds
    lora_loadable: list[Name] = Field(default_factory=list)  # those it loads when a request names one


class IterationStats(Message):
    """worker.executor.types.IterationStats, field for field."""

    kind: ClassVar[str] = "iteration_stats"

    timestamp: float
    iter: Count
    iter_latency_ms: Millis
    num_active_requests: Count
    num_queued_requests: Count
    num_context_requests: Count
    num_generation_requests: Count
    num_scheduled_tokens: Count
    max_num_blocks: Count
    free_num_blocks: Count
    used_num_blocks: Count
    reused_blocks: Count
    num_draft_tokens: Count = 0
    num_accepted_draft_tokens: Count = 0
    num_preempted: Count = 0


class RequestStats(Message):
    """worker.executor.types.RequestStats, keyed by the client's request id."""

    kind: ClassVar[str] = "request_stats"

    request_id: Name
    state: Literal["queued", "context", "generation", "preempted", "finished"]
    prompt_tokens: Count
    context_prefill_position: Count
    num_generated_tokens: Count
    queue_time_ms: Millis | None
    time_to_first_token_ms: Millis | None
    allocated_blocks: Count
    reused_blocks: Count
    num_draft_tokens: Count = 0
    num_accepted_draft_tokens: Count = 0
    speculation_off_reason: str | None = None
    timestamp: float = Field(default_factory=time.time)
