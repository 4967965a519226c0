"""Records a worker publishes about itself: load (in heartbeats and result
batches), registry entry, and the executor's iteration and request stats (built
from their one declaration, protocol/stats.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field

from protocol import stats
from protocol.base import Message, Name, WireModel
from protocol.derive import wire_model
from protocol.status import RequestState

Count = Annotated[int, Field(ge=0)]


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
    # Disaggregated serving (protocol/kv_transfer.py): what gateways send it, and where a prefill
    # worker pushes KV blocks to it (None: it takes none).
    role: Literal["prefill", "decode", "both"] = "both"
    kv_address: Name | None = None


class _IterationStatsMessage(Message):
    kind: ClassVar[str] = "iteration_stats"


class _RequestStatsMessage(Message):
    kind: ClassVar[str] = "request_stats"


if TYPE_CHECKING:
    # What type checkers see: the declaration's fields on a message, built from keywords.
    class IterationStats(_IterationStatsMessage, stats.IterationStats):
        def __init__(self, **fields: Any) -> None: ...

    class RequestStats(_RequestStatsMessage, stats.RequestStats):
        def __init__(self, **fields: Any) -> None: ...
else:
    IterationStats = wire_model(stats.IterationStats, base=_IterationStatsMessage, module=__name__)
    # Keyed by the client's request id; the state by its name.
    RequestStats = wire_model(stats.RequestStats, base=_RequestStatsMessage, module=__name__, types={
        "request_id": Name, "state": Literal[tuple(state.value for state in RequestState)]})
