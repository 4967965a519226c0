"""Request migration: where a request goes on when its worker is lost, or ends it for
the worker's own reason (its engine failed, its drain ran out of time).

A request its client has received nothing of is sent again as it came. A started one
continues as a continuation (protocol/continuation.py) of every token the lost worker
sent for it, so its stream goes on where it stopped: no token twice, none missing, and
on deterministic workers (docs/deterministic.md) exactly the tokens of a run without
the fault. What a continuation cannot reproduce (beams, several sequences, log probs)
ends with an error that says so, as does a request moved `--migration-limit` times."""

from __future__ import annotations

from dataclasses import dataclass

import protocol
from protocol.continuation import not_resumable


def tracks_tokens(submit: protocol.Submit) -> bool:
    """Whether a request's received tokens are kept for a continuation: a streamed one
    that a continuation can carry on (a request not streamed has received nothing
    until it ends)."""
    return submit.streaming and not_resumable(submit) is None


@dataclass(frozen=True, slots=True)
class Ended:
    """Why a request is not moved: `outcome` for the metrics, `why` for its client."""

    outcome: str  # "limit" or "not_resumable"
    why: str


def next_run(submit: protocol.Submit, started: bool, received: list[int], moves: int,
             limit: int) -> protocol.Submit | Ended:  # fmt: skip
    """The submit that carries a request on to another worker, or why it ends instead.

    `received`: the tokens workers sent for it so far (with those its client resumed
    from); `moves`: how often it was moved already."""
    if moves >= limit:
        return Ended("limit", f"it was moved to another worker {moves} times already (the gateway's "
                     "--migration-limit)")  # fmt: skip
    if started and (why := not_resumable(submit)) is not None:
        return Ended("not_resumable", f"a started request with {why} is not migrated")
    if not received:
        return submit
    return submit.model_copy(update={"resumed_token_ids": list(received)})
