"""With real processes: one client's burst of long text prompts must not stall the
gateway's socket loop. Tokenized on that loop, they would hold the GIL for seconds: its
heartbeats would stop, the worker would declare it silent and abort every request it
had, and another client's stream would fail."""

from __future__ import annotations

import time

import pytest

from clients.client import Client, FinishReason, RequestError
from gateway.server import INLINE_TEXT_CHARS
from tests.procs import CLIENT_OPTIONS, HEARTBEAT_S, MISSED, Stack, long_context_checkpoint

# A context this long lets ~3 MB of text pass the byte bound (context x the tiny vocabulary's
# 12-byte longest token), so each prompt is tokenized in full, for seconds, before its length
# is known to exceed the context: longer than the 2 s a silent peer is given (tests.procs).
CONTEXT = 262144
TEXT = "Paged attention keeps the KV cache in fixed-size blocks. " * 50000
BURST = 2
STREAM_TOKENS = 300


@pytest.fixture(scope="module")
def service(service_model, redis_server, tmp_path_factory):
    model = long_context_checkpoint(service_model, tmp_path_factory.mktemp("models") / "tiny-llama-256k", CONTEXT)
    s = Stack(model, redis_server.url, tmp_path_factory.mktemp("tokenizing"))
    try:
        s.worker("--kv-tokens", "8192")
        s.gateway()
        s.gateways[0].wait_workers(1)
        yield s
    finally:
        s.close()


def test_a_burst_of_long_prompts_leaves_another_clients_stream_whole(service):
    assert INLINE_TEXT_CHARS < len(TEXT) < CONTEXT * 12
    gateway = service.gateways[0].endpoint
    with Client([gateway], **CLIENT_OPTIONS) as victim, \
            Client([gateway], **CLIENT_OPTIONS) as flooder:  # fmt: skip
        stream = victim.stream([5, 6, 7], max_tokens=STREAM_TOKENS, min_tokens=STREAM_TOKENS, temperature=0.0)
        next(iter(stream))
        started = time.monotonic()
        burst = [flooder.submit(TEXT, max_tokens=4) for _ in range(BURST)]
        for future in burst:
            with pytest.raises(RequestError, match="exceeds the model's context"):
                future.result(timeout=120)
        took = time.monotonic() - started
        result = stream.result(timeout=60)
        assert len(result.token_ids) == STREAM_TOKENS
        assert result.finish_reason == FinishReason.LENGTH
        # Short text prompts are still served meanwhile, and afterwards.
        assert len(victim.generate("hello world", max_tokens=4, timeout=30).token_ids) == 4
    # The burst took longer than a peer may stay silent: had it run on the loop, peers would be lost.
    assert took > HEARTBEAT_S * MISSED, took
    assert "silent" not in service.workers[0].log()
    assert " lost " not in service.gateways[0].log()
