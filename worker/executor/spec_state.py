"""One sequence's speculative-decoding state. Its own module because a Sequence
holds one and speculative.py, which reads sequences, must not be imported by
sequence.py (the two would import each other)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from worker.executor.types import SpeculativeConfig

INT32 = "i"  # prompt lookup's packed token ids


@dataclass(slots=True)
class SpecState:
    """One sequence's speculation: its config and its acceptance counts."""

    config: SpeculativeConfig
    num_drafted: int = 0  # draft tokens verified
    num_accepted: int = 0  # draft tokens accepted
    # DRAFT_TOKENS: how many output tokens were checked against the caller's, and
    # whether the output stopped following them.
    checked: int = 0
    diverged: bool = False
    # PROMPT_LOOKUP: the tokens so far packed as int32 bytes, extended as they grow
    # (prompt_lookup searches them with bytes.rfind; repacking on every step would
    # cost more than the search).
    packed: bytearray = field(default_factory=bytearray)
    filled: int = 0

    def packed_tokens(self, tokens: list[int]) -> bytearray:
        """`tokens` (which only ever grow) as native int32 bytes."""
        n = len(tokens)
        if n > self.filled:
            self.packed += array(INT32, tokens[self.filled : n]).tobytes()
            self.filled = n
        return self.packed

