"""The ZeroMQ client library against a real gateway and worker: sync and asyncio,
futures, streaming, cancel, timeouts, use from many threads, failover."""

from __future__ import annotations

import asyncio
import threading

import pytest

from clients.async_client import AsyncClient
from clients.client import Client, FinishReason, RequestError, SamplingParams
from clients.wire import to_submit
from tests.procs import CLIENT_OPTIONS, free_port, stack

SEEDED = {"max_tokens": 12, "temperature": 0.8, "top_k": 20, "seed": 11}


@pytest.fixture(scope="module")
def service(long_model, redis_server, tmp_path_factory):
    with stack(long_model, redis_server.url, tmp_path_factory.mktemp("client")) as s:
        yield s


@pytest.fixture
def client(service):
    with Client([service.gateways[0].endpoint], **CLIENT_OPTIONS) as c:
        yield c


def test_generate_and_stream_agree(client):
    whole = client.generate("The quick brown fox", timeout=30, **SEEDED)
    assert len(whole.token_ids) == 12
    assert whole.finish_reason == FinishReason.LENGTH
    chunks = list(client.stream("The quick brown fox", **SEEDED))
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in chunks) == whole.text
    assert [c.is_final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].finish_reason == FinishReason.LENGTH


def test_token_id_prompts_and_stop_strings(client):
    full = client.generate([5, 6, 7], max_tokens=40, temperature=0.0, timeout=30)
    stop = full.text[10:13]
    if not stop.strip() or "\ufffd" in stop:
        pytest.skip("the random model's text has no usable stop string here")
    cut = client.generate([5, 6, 7], max_tokens=40, temperature=0.0, stop=[stop], timeout=30)
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason == FinishReason.STOP_WORDS


def test_future_timeout_and_cancel(client):
    future = client.submit([8, 9], max_tokens=6000, min_tokens=6000, temperature=0.0)
    with pytest.raises(TimeoutError):
        future.result(timeout=0.2)
    future.cancel()
    result = future.result(timeout=30)
    assert result.finish_reason == FinishReason.CANCELLED
    assert future.done()


def test_errors_raise_request_error(client):
    with pytest.raises(RequestError, match="vocabulary") as excinfo:
        client.generate([999_999], max_tokens=3, timeout=30)
    assert excinfo.value.code == "invalid_request"


def test_bad_arguments_fail_before_sending():
    with pytest.raises(ValueError, match="max_tokens"):
        to_submit("hi", SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="gateways"):
        Client("tcp://127.0.0.1:1")


def test_one_client_shared_by_many_threads(client):
    expected = client.generate([10, 11], timeout=30, **SEEDED).token_ids
    results: list[list[int]] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(5):
                results.append(client.generate([10, 11], timeout=30, **SEEDED).token_ids)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == [expected] * 40


def test_async_client(service):
    async def main() -> None:
        async with AsyncClient([service.gateways[0].endpoint], **CLIENT_OPTIONS) as ac:
            whole = await ac.generate("Paged attention", timeout=30, **SEEDED)
            chunks = [c async for c in ac.stream("Paged attention", **SEEDED)]
            assert [t for c in chunks for t in c.token_ids] == whole.token_ids
            many = await asyncio.gather(*(ac.generate([12, i], max_tokens=4, timeout=30) for i in range(20)))
            assert all(len(r.token_ids) == 4 for r in many)
            request = ac.submit([8, 9], max_tokens=6000, min_tokens=6000)
            with pytest.raises(asyncio.TimeoutError):
                await request.result(timeout=0.2)
            request.cancel()
            assert (await request.result(timeout=30)).finish_reason == FinishReason.CANCELLED
            with pytest.raises(RequestError, match="vocabulary"):
                await ac.generate([999_999], max_tokens=3, timeout=30)

    asyncio.run(main())


def test_unstarted_requests_fail_over_to_the_next_gateway(service):
    dead = f"tcp://127.0.0.1:{free_port()}"  # nothing listens here
    with Client([dead, service.gateways[0].endpoint], **CLIENT_OPTIONS) as c:
        result = c.generate([13, 14], max_tokens=5, timeout=30)
        assert len(result.token_ids) == 5
        assert c.gateway == service.gateways[0].endpoint


def test_beam_search_matches_the_executor_in_process(service, client):
    from worker.executor import Executor, ExecutorConfig, KvCacheConfig, Request, SamplingConfig

    prompt = [5, 6, 7, 8]
    config = ExecutorConfig(max_beam_width=2, kv_cache_config=KvCacheConfig(max_tokens=4096))
    with Executor.from_model(service.model, config) as ex:
        rid = ex.enqueue_request(Request(input_token_ids=prompt, max_tokens=8, num_return_sequences=2,
                                         sampling_config=SamplingConfig(beam_width=2)))  # fmt: skip
        responses = ex.await_responses(rid, timeout=60)
        while not any(r.error_msg or (r.result and r.result.is_final) for r in responses):
            responses += ex.await_responses(rid, timeout=60)
        final = responses[-1]
        assert final.result is not None, final.error_msg
        expected = final.result.output_token_ids
    whole = client.generate(prompt, max_tokens=8, beam_width=2, num_return_sequences=2, timeout=30)
    assert [o.token_ids for o in whole.outputs] == expected
    chunks = list(client.stream(prompt, max_tokens=8, beam_width=2, num_return_sequences=2))
    assert chunks[-1].is_final
    assert chunks[-1].token_ids == expected[0]
    assert all(o.finish_reason is not None for o in whole.outputs)


def test_log_probs_and_top_n_travel_to_the_client(client):
    out = client.generate([5, 6, 7], max_tokens=6, temperature=0.0, return_log_probs=True, top_n_log_probs=3,
                          timeout=30).outputs[0]  # fmt: skip
    assert out.log_probs is not None
    assert len(out.log_probs) == 6
    assert out.top_token_ids is not None
    assert out.top_log_probs is not None
    assert [len(t) for t in out.top_token_ids] == [3] * 6
    # Greedy: the chosen token is the likeliest, with the log prob reported for it.
    assert [t[0] for t in out.top_token_ids] == out.token_ids
    assert [p[0] for p in out.top_log_probs] == pytest.approx(out.log_probs, abs=1e-4)


def test_logits_travel_to_the_client(client):
    params = SamplingParams(max_tokens=4, temperature=0.0, return_context_logits=True, return_generation_logits=True)
    for out in (client.generate([5, 6, 7], params, timeout=30), client.stream([5, 6, 7], params).result(timeout=30)):
        logits = out.outputs[0].generation_logits
        assert out.context_logits is not None and logits is not None
        assert out.context_logits.shape == (3, logits.shape[1])
        assert logits.shape[0] == 4  # streamed: one row per response, joined
        assert list(logits.argmax(axis=1)) == out.token_ids  # greedy picks each row's best


def test_embed_from_every_client_api_agrees(client, service, long_model):
    """Client.embed, AsyncClient.embed and the in-process LLM.embed give the same unit
    vectors, in the order of the inputs (the vectors themselves are checked against
    transformers in tests/worker/executor/test_embeddings.py)."""
    import numpy as np

    from clients.llm import LLM
    from worker.executor import ExecutorConfig

    inputs: list[str | list[int]] = ["The quick brown fox", [5, 6, 7, 8], "jumps over the lazy dog"]
    remote = client.embed(inputs, timeout=30)
    mean = client.embed(inputs, pooling="mean", timeout=30)

    async def from_async():
        async with AsyncClient([service.gateways[0].endpoint], **CLIENT_OPTIONS) as c:
            return await c.embed(inputs, timeout=30)

    with LLM(long_model, ExecutorConfig(backend="numpy")) as llm:
        local = llm.embed(inputs)
        local_mean = llm.embed(inputs, pooling="mean")
    # float32 sums in batches of other shapes: agreement to a few float32 ulps of unit vectors
    for got, want in ((remote, local), (asyncio.run(from_async()), local), (mean, local_mean)):
        assert len(got) == len(want) == 3
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, atol=1e-5)
            assert abs(float(np.linalg.norm(g)) - 1.0) < 1e-5
    assert not np.allclose(remote[0], remote[2], atol=1e-3), "different inputs, the same vector"
    assert not np.allclose(remote[0], mean[0], atol=1e-3), "last-token and mean pooling agree"
    assert client.embed("one input alone", timeout=30)[0].shape == remote[0].shape
