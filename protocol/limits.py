"""Bounds on what `decode` accepts, all in one place.

Bulk numbers (token ids, per-token log probs, embedding bias, logits) travel as
packed bytes, so msgpack arrays stay short and `max_array_len` can be small. That
matters: msgpack preallocates a container of the length its header declares, so
a few kilobytes of nested headers could otherwise claim gigabytes. Packed lists
become Python lists after decoding, about 9x their wire size: `max_packed_values`
bounds that. Logits stay bytes and count only against the size limits.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Limits:
    max_message_bytes: int = 64 * MiB  # the whole encoded message
    max_str_len: int = 4 * MiB  # prompt text, grammars, JSON schemas
    max_bin_len: int = 64 * MiB  # packed arrays: a prompt's token ids, logits
    max_array_len: int = 4096  # responses in a batch, stop sequences, beams
    max_map_len: int = 64  # fields of one record
    max_depth: int = 8  # nested arrays and maps, the envelope counting as 1
    # Packed numbers (token ids, floats) one message may expand into Python lists;
    # at ~36 bytes each as Python ints, the default bounds that at ~150 MB.
    max_packed_values: int = 1 << 22

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be >= 1, got {getattr(self, name)}")


DEFAULT_LIMITS = Limits()


# Messages any socket loop (worker, gateway, client) takes from one socket per turn:
# enough to amortize a poll, few enough (in number and in time) that heartbeats and
# the other sockets are served while one peer floods.
TURN_MESSAGES = 64
TURN_SECONDS = 0.02


def socket_turn() -> Iterator[int]:
    """Counts off one turn's messages; stops early once the turn's time is up."""
    deadline = time.monotonic() + TURN_SECONDS
    for i in range(TURN_MESSAGES):
        if i and time.monotonic() > deadline:
            return
        yield i
