"""With real processes: results larger than a message.

A model with a wide vocabulary makes context logits big (prompt tokens x vocab x
4 bytes), as a 400-token prompt makes 79 MB on the default model. One
request whose logits can never fit in a message gets an error of its own; two
whose logits fit alone but not together in the step that ends them each get
theirs; and streams decoding in the same steps get every token, including those of
the step that carried the oversize batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clients.client import Client, FinishReason
from clients.connection import RequestError
from tests.checkpoints import write_tokenizer
from tests.procs import CLIENT_OPTIONS, stack

WIDE_VOCAB = 32768
ROW_BYTES = WIDE_VOCAB * 4
LIMIT = 64 << 20  # protocol.Limits.max_message_bytes
TOO_LONG = LIMIT // ROW_BYTES + 88  # ~79 MB of logits alone: can never be one message
HALF = LIMIT // ROW_BYTES * 3 // 5  # ~40 MB each: one fits, two together do not
STREAM_TOKENS = 60


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a 32k vocabulary (the token ids tested stay within the tokenizer's)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=WIDE_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    directory = tmp_path_factory.mktemp("models") / "tiny-wide"
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return directory


def test_results_over_the_message_limit_fail_alone_and_cost_no_stream_a_token(
    wide_model: Path, redis_url: str, tmp_path: Path
) -> None:
    assert TOO_LONG * ROW_BYTES > LIMIT and 2 * HALF * ROW_BYTES > LIMIT > HALF * ROW_BYTES + (1 << 20)
    rng = np.random.default_rng(0)

    def prompt(n: int) -> list[int]:
        return [int(t) for t in rng.integers(5, 300, n)]

    with stack(wide_model, redis_url, tmp_path) as s, \
            Client([s.gateways[0].endpoint], **CLIENT_OPTIONS) as client:  # fmt: skip
        streams = [
            client.stream(prompt(8), max_tokens=STREAM_TOKENS, min_tokens=STREAM_TOKENS, temperature=0.0)
            for _ in range(4)
        ]
        for future in streams:  # every stream decodes before the large requests arrive
            next(iter(future))
        too_large = client.submit(prompt(TOO_LONG), max_tokens=1, return_context_logits=True)
        half_prompts = [prompt(HALF), prompt(HALF)]
        halves = [client.submit(p, max_tokens=1, return_context_logits=True) for p in half_prompts]

        with pytest.raises(RequestError, match="logits"):
            too_large.result(timeout=60)
        together = [future.result(timeout=60).context_logits for future in halves]
        for future in streams:
            result = future.result(timeout=60)
            assert len(result.token_ids) == STREAM_TOKENS
            assert result.finish_reason == FinishReason.LENGTH
        # Each half's logits are its own prompt's: the same as when it runs alone.
        for p, logits in zip(half_prompts, together, strict=True):
            alone = client.generate(p, max_tokens=1, return_context_logits=True, timeout=60).context_logits
            assert logits is not None and alone is not None
            assert logits.shape == alone.shape == (HALF, WIDE_VOCAB)
            assert np.allclose(logits, alone, atol=1e-4)
        worker_log = s.workers[0].log()
        assert "ProtocolError" not in worker_log and "Traceback" not in worker_log
