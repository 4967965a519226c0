"""A request whose logits could never fit in one message is refused at admission."""

from __future__ import annotations

import protocol
from worker.service.admission import logits_bytes, too_large


def _submit(**fields: object) -> protocol.Submit:
    return protocol.Submit.model_validate({"request_id": "r", "input_token_ids": [1] * 400, "max_tokens": 16, **fields})


def test_logits_beyond_a_message_are_refused() -> None:
    """400 prompt tokens' context logits of a 49,152-token vocabulary (~79 MB) can never
    fit in a message: the request is refused before it runs, not left hanging."""
    msg = _submit(output_config={"return_context_logits": True})
    assert logits_bytes(msg, 49_152) == 400 * 49_152 * 4
    problem = too_large(msg, 49_152, protocol.DEFAULT_LIMITS)
    assert problem is not None and "exceed what one message can carry" in problem
    assert too_large(msg, 320, protocol.DEFAULT_LIMITS) is None


def test_generation_logits_count_every_token_unless_streamed() -> None:
    whole = _submit(max_tokens=2000, output_config={"return_generation_logits": True},
                    sampling_config={"beam_width": 2})  # fmt: skip
    assert logits_bytes(whole, 10_000) == 2 * 2000 * 10_000 * 4
    assert too_large(whole, 10_000, protocol.DEFAULT_LIMITS) is not None
    streamed = whole.model_copy(update={"streaming": True})
    assert too_large(streamed, 10_000, protocol.DEFAULT_LIMITS) is None
    assert logits_bytes(_submit(), 10_000) == 0
