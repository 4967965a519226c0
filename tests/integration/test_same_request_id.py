"""Two clients that choose the same request id through one gateway are two
requests: each gets its own complete stream, and a cancel or a client going
away ends only its own (real gateway and worker processes, real sockets)."""

from __future__ import annotations

import pytest

from clients.client import Client, FinishReason, RequestFuture, RequestOutput
from tests.procs import CLIENT_OPTIONS, stack

GREEDY = {"temperature": 0.0}
PROMPTS = ([5, 6, 7, 8], [40, 41, 42])
MAX_TOKENS = 48
LONG = {"max_tokens": 6000, "min_tokens": 6000, **GREEDY}  # seconds of work for the tiny model


@pytest.fixture(scope="module")
def service(long_model, redis_server, tmp_path_factory):
    with stack(long_model, redis_server.url, tmp_path_factory.mktemp("same-id"), workers=1, gateways=1) as s:
        yield s


def _client(service) -> Client:
    return Client([service.gateways[0].endpoint], **CLIENT_OPTIONS)


def _solo(service, prompt: list[int], max_tokens: int) -> RequestOutput:
    with _client(service) as c:
        return c.generate(prompt, max_tokens=max_tokens, min_tokens=max_tokens, timeout=60, **GREEDY)


def _streamed(future: RequestFuture) -> tuple[list[int], str]:
    chunks = list(future)
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks)


def test_both_clients_get_their_own_complete_stream(service):
    solo = [_solo(service, p, MAX_TOKENS) for p in PROMPTS]
    assert solo[0].token_ids != solo[1].token_ids  # so a mix-up would show
    with _client(service) as a, _client(service) as b:
        futures = [
            c.stream(p, request_id="same", max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, **GREEDY)
            for c, p in zip((a, b), PROMPTS, strict=True)
        ]
        streams = [_streamed(f) for f in futures]
        results = [f.result(timeout=60) for f in futures]
    for (tokens, text), result, alone in zip(streams, results, solo, strict=True):
        assert result.request_id == "same"
        assert result.finish_reason == FinishReason.LENGTH
        assert tokens == result.token_ids == alone.token_ids
        assert text == result.text == alone.text


def test_a_cancel_ends_only_the_cancelling_client_s_request(service):
    solo = _solo(service, PROMPTS[1], 300)
    with _client(service) as a, _client(service) as b:
        fa = a.stream(PROMPTS[0], request_id="same-cancel", **LONG)
        fb = b.stream(PROMPTS[1], request_id="same-cancel", max_tokens=300, min_tokens=300, **GREEDY)
        next(iter(fa))  # running on the worker, and b's with it
        fa.cancel()
        ra, rb = fa.result(timeout=30), fb.result(timeout=60)
    assert ra.finish_reason == FinishReason.CANCELLED
    assert 0 < len(ra.token_ids) < LONG["max_tokens"]
    assert rb.finish_reason == FinishReason.LENGTH
    assert rb.token_ids == solo.token_ids
    service.wait_idle(service.workers[0])


def test_a_client_going_away_ends_only_its_request(service):
    solo = _solo(service, PROMPTS[1], 64)
    a = _client(service)
    fa = a.stream(PROMPTS[0], request_id="same-gone", **LONG)
    next(iter(fa))
    with _client(service) as b:
        fb = b.stream(PROMPTS[1], request_id="same-gone", **LONG)
        next(iter(fb))
        a.close()  # silent from now on: the gateway cancels its request when its heartbeats stop
        service.gateways[0].wait_log("silent: cancelling its 1 requests", timeout=15)
        fb.cancel()  # b's request is still there to cancel
        rb = fb.result(timeout=30)
    assert rb.finish_reason == FinishReason.CANCELLED
    assert rb.token_ids[:64] == solo.token_ids
    service.wait_idle(service.workers[0])


def test_a_redis_cancel_flag_names_the_client_s_id_even_when_the_wire_id_differs(service):
    """The second request under a taken id travels to the worker under another wire id; the worker
    polls the cancel flag of the client's id for it all the same (and records its stats there)."""
    keys = service.keys
    with _client(service) as a, _client(service) as b:
        fa = a.stream(PROMPTS[0], request_id="flagged", **LONG)
        next(iter(fa))
        fb = b.stream(PROMPTS[1], request_id="flagged", **LONG)
        next(iter(fb))  # both running; b's under a wire id of the gateway's
        service.redis.set(keys.cancel("flagged"), "1", ex=60)
        results = [f.result(timeout=30) for f in (fa, fb)]
    assert [r.finish_reason for r in results] == [FinishReason.CANCELLED, FinishReason.CANCELLED]
