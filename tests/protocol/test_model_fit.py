"""The vocabulary and context rules: one wording, whether the gateway or the
executor finds the problem."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import zmq

import protocol
from gateway.server import Gateway
from gateway.workers import WorkerLink
from protocol.model_fit import context_overflow, token_outside_vocabulary
from worker.executor import ExecutorConfig, PromptTuningConfig, Request
from worker.executor.validation import RequestError, validate_request
from worker.models.config import ModelConfig

VOCAB, HIDDEN, CONTEXT = 32, 8, 64
MODEL = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=16, num_layers=1,
                    num_heads=2, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6, rope_theta=10000.0,
                    max_position_embeddings=CONTEXT, tie_word_embeddings=False, attention_bias=False)  # fmt: skip


@pytest.fixture
def link() -> Iterator[WorkerLink]:
    ctx = zmq.Context()
    info = protocol.WorkerInfo(worker_id="w", address="tcp://127.0.0.1:1", models=["m"], host="h", pid=1,
                               started_at=0.0)  # fmt: skip
    sock = ctx.socket(zmq.DEALER)
    yield WorkerLink(info, sock, vocab_size=VOCAB, max_seq_len=CONTEXT)
    sock.close(0)
    ctx.term()


def _executor_error(ids: list[int], max_tokens: int, table_rows: int) -> str:
    table = None if not table_rows else PromptTuningConfig(np.zeros((table_rows, HIDDEN), np.float32))
    request = Request(input_token_ids=ids, max_tokens=max_tokens, prompt_tuning_config=table)
    with pytest.raises(RequestError) as caught:
        validate_request(request, MODEL, ExecutorConfig(), CONTEXT)
    return str(caught.value)


def _gateway_error(link: WorkerLink, ids: list[int], max_tokens: int, table_rows: int) -> str | None:
    table = None
    if table_rows:
        data = np.zeros((table_rows, HIDDEN), np.float32).tobytes()
        table = protocol.PromptTuningConfig(embedding_table=protocol.Logits(shape=[table_rows, HIDDEN], data=data))
    submit = protocol.Submit(request_id="r", input_token_ids=ids, max_tokens=max_tokens, prompt_tuning_config=table)
    return Gateway._check_fits(submit, link)


@pytest.mark.parametrize(
    ("ids", "max_tokens", "table_rows", "expected"),
    [
        ([1, VOCAB], 4, 0, f"input_token_ids: token id {VOCAB} is outside the vocabulary [0, {VOCAB})"),
        ([1, VOCAB + 2], 4, 2, f"input_token_ids: token id {VOCAB + 2} is outside the vocabulary and the "
                               f"prompt-tuning table [0, {VOCAB} + 2)"),
        ([1] * 60, 5, 0, f"prompt (60 tokens) + max_tokens (5) exceeds the model's context of {CONTEXT} tokens"),
    ],
)
def test_gateway_and_executor_refuse_in_the_same_words(link: WorkerLink, ids: list[int], max_tokens: int,
                                                       table_rows: int, expected: str) -> None:
    assert _gateway_error(link, ids, max_tokens, table_rows) == expected
    assert _executor_error(ids, max_tokens, table_rows) == expected


def test_what_fits_passes_both(link: WorkerLink) -> None:
    assert _gateway_error(link, [0, VOCAB - 1], CONTEXT - 2, 0) is None
    assert _gateway_error(link, [0, VOCAB + 1], 4, 2) is None  # ids past the vocabulary name table rows
    validate_request(Request(input_token_ids=[0, VOCAB - 1], max_tokens=CONTEXT - 2), MODEL, ExecutorConfig(),
                     CONTEXT)  # fmt: skip


def test_the_rules_at_their_edges() -> None:
    assert token_outside_vocabulary([0, VOCAB - 1], VOCAB) is None
    assert token_outside_vocabulary([-1], VOCAB) is not None
    assert token_outside_vocabulary([VOCAB + 1], VOCAB, table_rows=2) is None
    assert token_outside_vocabulary([VOCAB + 2], VOCAB, table_rows=2) is not None
    assert context_overflow(60, 4, CONTEXT) is None
    assert context_overflow(60, 5, CONTEXT) is not None
