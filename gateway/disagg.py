"""Disaggregated serving, the gateway's part: which requests are prefilled on one
worker and decoded on another, and the two workers (protocol/kv_transfer.py).

Prefill workers (`--role prefill`) take new requests, chosen by the prefix router
among them; the decode worker is the least loaded of those that take KV blocks (a
registered `kv_address`, `--role decode` or `both`). The gateway names the decode
worker's KV endpoint in the submit and keeps nothing else: when the prefill worker
says HandedOff, the request goes on as a continuation, the decode worker first, any
worker if that one is gone; a prefill worker lost before that is an ordinary
migration (gateway/migration.py).
"""

from __future__ import annotations

import protocol
from gateway.migration import tracks_tokens
from gateway.prefix_router import PrefixRouter
from gateway.workers import WorkerLink, eligible, least_loaded


def splits(submit: protocol.Submit) -> bool:
    """Whether a request can be split: a new streamed one over token ids, more than its
    first token to generate, under the base model, continuable (gateway/migration.py)."""
    return (submit.input_token_ids is not None and submit.max_tokens > 1 and submit.resumed_token_ids is None
            and submit.lora is None and submit.prompt_tuning_config is None and submit.embedding_config is None
            and tracks_tokens(submit))  # fmt: skip


def pick_pair(router: PrefixRouter, workers: list[WorkerLink], model: str | None,
              submit: protocol.Submit) -> tuple[WorkerLink, WorkerLink] | None:  # fmt: skip
    """(prefill worker, decode worker), or None where there is no such pair to split over."""
    available = eligible(workers, model, None)
    decoders = [w for w in available if w.info.kv_address is not None and w.info.role != "prefill"]
    prefillers = [w for w in available if w.info.role == "prefill"]
    if not decoders or not prefillers:
        return None
    decode = least_loaded(decoders, model)
    prefill = router.pick(prefillers, model, submit)
    if decode is None or prefill is None:
        return None
    return prefill, decode


def whole_request_workers(workers: list[WorkerLink]) -> list[WorkerLink]:
    """Where a request that is not split goes: any worker but decode-only ones, while any
    of those is up (they are kept for decoding); all of them otherwise."""
    others = [w for w in workers if w.info.role != "decode" and w.ready and not w.draining]
    return others or workers
