"""The executor's statistics, declared once: one record per iteration, and one
per request (when it ends, or after every iteration when asked for).

Plain dataclasses, standard library only: the executor produces these as they
are; the wire models of the same names (protocol/records.py) are built from
them, with the request keyed by the client's request id rather than the
executor's integer one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from protocol.options import REQUIRED, option
from protocol.status import RequestState


@dataclass(slots=True)
class IterationStats:
    """What one executor iteration did."""

    timestamp: float = option(REQUIRED, "unix time at the iteration's end")
    iter: int = option(REQUIRED, "the iteration's number", ge=0)
    iter_latency_ms: float = option(REQUIRED, "the iteration's wall time", ge=0.0)
    num_active_requests: int = option(REQUIRED, "requests admitted and not finished", ge=0)
    num_queued_requests: int = option(REQUIRED, "requests waiting to be admitted", ge=0)
    num_context_requests: int = option(REQUIRED, "requests whose prompt this iteration processed", ge=0)
    num_generation_requests: int = option(REQUIRED, "requests that generated this iteration", ge=0)
    num_scheduled_tokens: int = option(REQUIRED, "tokens this iteration computed", ge=0)
    max_num_blocks: int = option(REQUIRED, "KV cache blocks in all", ge=0)
    free_num_blocks: int = option(REQUIRED, "KV cache blocks free", ge=0)
    used_num_blocks: int = option(REQUIRED, "KV cache blocks held by requests", ge=0)
    reused_blocks: int = option(REQUIRED, "cumulative prefix-cache hits, in blocks", ge=0)
    # The host tier (KvCacheConfig.host_cache_size): full prefix blocks evicted from the
    # device pool are copied there and loaded back on a hit; all 0 without one.
    reused_host_blocks: int = option(0, "of the cumulative prefix-cache hits, those loaded from the host tier",
                                     ge=0)
    offloaded_blocks: int = option(0, "cumulative blocks copied from the device pool to the host tier", ge=0)
    max_num_host_blocks: int = option(0, "host tier blocks in all", ge=0)
    cached_num_host_blocks: int = option(0, "host tier blocks holding a cached block", ge=0)
    num_draft_tokens: int = option(0, "speculative decoding: draft tokens proposed this iteration", ge=0)
    num_accepted_draft_tokens: int = option(0, "speculative decoding: draft tokens accepted this iteration", ge=0)
    # MAX_UTILIZATION: their KV was dropped to make room, and they recompute their tokens
    # when admitted again.
    num_preempted: int = option(0, "sequences this iteration's schedule preempted", ge=0)
    # Router statistics, for placing experts: the load of each expert of each layer.
    expert_tokens: list[list[int]] | None = option(  # noqa: RUF009 (a field())
        None, "mixture-of-experts models: the tokens routed to each expert, [layer][expert] (zeros for dense "
        "layers), since the previous record that has them (steps that sample nothing carry theirs over); "
        "None for dense models")


@dataclass(slots=True)
class RequestStats:
    """Where one request stands."""

    request_id: int = option(REQUIRED, "the executor's request id (on the wire, the client's)")
    state: RequestState = option(REQUIRED, "queued, context, generation, preempted or finished")  # noqa: RUF009 (a field())
    prompt_tokens: int = option(REQUIRED, "tokens in the prompt", ge=0)
    context_prefill_position: int = option(REQUIRED, "prompt tokens processed so far", ge=0)
    num_generated_tokens: int = option(REQUIRED, "tokens generated so far", ge=0)
    queue_time_ms: float | None = option(REQUIRED, "from arrival to first scheduled; None: not yet", ge=0.0)
    time_to_first_token_ms: float | None = option(REQUIRED, "from arrival to the first token; None: not yet",
                                                  ge=0.0)
    allocated_blocks: int = option(REQUIRED, "KV cache blocks it holds", ge=0)
    reused_blocks: int = option(REQUIRED, "prompt blocks found in the prefix cache", ge=0)
    reused_host_blocks: int = option(0, "of those, the blocks loaded from the host tier", ge=0)
    num_draft_tokens: int = option(0, "speculative decoding: draft tokens verified", ge=0)
    num_accepted_draft_tokens: int = option(0, "speculative decoding: draft tokens accepted", ge=0)
    speculation_off_reason: str | None = option(
        None, "why a request that asked for speculation did not speculate (None: it did, or never asked)")
    timestamp: float = option(REQUIRED, "unix time of the record", factory=time.time)
