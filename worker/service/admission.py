"""What a worker refuses at admission because its result could never be sent.

A response is one message, and a message has a size limit: logits grow with the
prompt, the output and the vocabulary, so a request asking for too many of them
is refused before it runs instead of failing after.
"""

from __future__ import annotations

import protocol

# Room in a message for what is not logits: token ids, log probs, the envelope.
_HEADROOM_BYTES = 1 << 20
_FLOAT_BYTES = 4


def logits_bytes(msg: protocol.Submit, vocab_size: int) -> int:
    """The logits one response of this request may carry, in bytes."""
    rows = 0
    if msg.output_config.return_context_logits:
        rows += len(msg.input_token_ids or ())
    if msg.output_config.return_generation_logits:
        # Streamed, a response carries one step's; otherwise the whole output's, for each beam.
        rows += msg.sampling_config.beam_width * (1 if msg.streaming else msg.max_tokens)
    return rows * vocab_size * _FLOAT_BYTES


def too_large(msg: protocol.Submit, vocab_size: int, limits: protocol.Limits) -> str | None:
    """Why this request's result cannot fit in a message, or None."""
    size = logits_bytes(msg, vocab_size)
    room = limits.max_message_bytes - _HEADROOM_BYTES
    if size <= room:
        return None
    return (
        f"the logits asked for ({size} bytes: {size // (vocab_size * _FLOAT_BYTES)} rows of {vocab_size}) "
        f"exceed what one message can carry ({room} bytes); ask for fewer (a shorter prompt, fewer tokens, "
        f"streaming, or no logits)"
    )
