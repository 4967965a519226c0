"""Several submits in one message, gateway to worker.

A burst of requests reaches a gateway in one turn of its loop; sent one message each,
every request costs a send, a receive and a poll on both sides, and the worker reads
the burst over several turns. A `SubmitBatch` carries what one turn dispatched to one
worker. Each submit in it is the whole encoded message it would be alone
(`[version, "submit", payload]`), which the worker decodes on its own: one bad submit
fails alone with its request named, under the limits a single message has, and no
submit nests deeper than it would alone. A worker says in its Ready
(`submit_batches`) that it takes them; to one that does not, submits go one by one.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from protocol.base import Message

# Submits in one batch: well under max_array_len, and few enough that a worker's turn
# on one batch stays short beside its other sockets.
MAX_SUBMITS = 256


class SubmitBatch(Message):
    """Submits for one worker, each an encoded Submit message, in the order they were dispatched."""

    kind: ClassVar[str] = "submits"

    submits: list[bytes] = Field(min_length=1, max_length=MAX_SUBMITS)
