"""A stop string in a streamed request, end to end: the gateway matches it on the
text of the columns it forwards, ends the stream there and stops the worker."""

from __future__ import annotations

import pytest

from clients.client import Client, FinishReason
from tests.procs import CLIENT_OPTIONS, stack

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def service(long_model, redis_server, tmp_path_factory):
    with stack(long_model, redis_server.url, tmp_path_factory.mktemp("streamed-stop")) as s:
        yield s


def test_a_stop_string_ends_a_streamed_request(service):
    with Client([service.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
        full = client.generate(PROMPT, max_tokens=40, min_tokens=40, temperature=0.0, timeout=30)
        text = full.text
        # Three characters of the random model's text, from well into it, first seen there.
        stops = [text[i : i + 3] for i in range(8, len(text) - 3) if text.index(text[i : i + 3]) == i]
        stop = next((s for s in stops if "\ufffd" not in s and s.strip()), None)
        if stop is None:
            pytest.skip("the random model's text has no usable stop string here")
        # Thousands of tokens without the stop string: the worker stops only because the gateway says so.
        future = client.stream(PROMPT, max_tokens=6000, min_tokens=6000, temperature=0.0, stop=[stop])
        chunks = list(future)
        result = future.result(timeout=30)
    cut = full.text[: full.text.index(stop)]
    assert "".join(c.text for c in chunks) == result.text == cut
    assert len(chunks) > 2  # streamed, not one whole answer
    assert [c.is_final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert result.finish_reason == chunks[-1].finish_reason == FinishReason.STOP_WORDS
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == result.token_ids == full.token_ids[: len(tokens)]
    assert len(tokens) <= 40  # the step that completed the stop string is the last
    service.wait_idle(service.workers[0])
