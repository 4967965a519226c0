"""/metrics of a worker and a gateway, scraped over HTTP during load and after it:
the series are there, and their values match the requests sent."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients.client import Client, FinishReason
from clients.connection import RequestError
from tests.procs import CLIENT_OPTIONS, Stack, free_port

LONG = {"max_tokens": 6000, "min_tokens": 6000, "temperature": 0.0}
SHORT = {"max_tokens": 8, "min_tokens": 8, "temperature": 0.0}
MODEL = "tiny-llama-long"


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"{name}{labels} not exported; have {sorted({n for n, _ in samples})}"
    return samples[key]


def test_metrics_match_the_requests_sent(long_model, redis_url, tmp_path):
    s = Stack(long_model, redis_url, tmp_path)
    wport, gport = free_port(), free_port()
    try:
        worker = s.worker("--metrics-port", str(wport))
        gateway = s.gateway("--metrics-port", str(gport))
        gateway.wait_workers(1)
        with Client([gateway.endpoint], **CLIENT_OPTIONS) as client:
            long = [client.stream([5, 6, 7, i + 8], **LONG) for i in range(4)]
            for f in long:
                next(iter(f))
            # During load: four requests decoding.
            w, g = scrape(wport), scrape(gport)
            assert value(w, "tokenwire_worker_active_requests") + value(w, "tokenwire_worker_queued_requests") == 4
            assert 0 < value(w, "tokenwire_worker_kv_blocks_used") < value(w, "tokenwire_worker_kv_blocks_total")
            assert value(w, "tokenwire_worker_redis_connected") == 1
            assert value(w, "tokenwire_worker_gateways_connected") == 1
            assert value(w, "tokenwire_worker_draining") == 0
            assert value(g, "tokenwire_gateway_requests_in_flight") == 4
            assert value(g, "tokenwire_gateway_workers", state="ready") == 1
            assert value(g, "tokenwire_gateway_redis_connected") == 1
            assert value(g, "tokenwire_gateway_clients_connected") == 1
            assert value(g, "tokenwire_gateway_generated_tokens_total", model=MODEL) > 0

            short = [client.submit([9, 10, i + 11], **SHORT) for i in range(16)]
            results = [f.result(timeout=60) for f in short]
            for f in long:
                f.cancel()
            results += [f.result(timeout=60) for f in long]
            with pytest.raises(RequestError):
                client.generate([10_000], max_tokens=4, timeout=30)  # out of the vocabulary
        assert [r.finish_reason for r in results] == [FinishReason.LENGTH] * 16 + [FinishReason.CANCELLED] * 4
        s.wait_idle(worker)
        sent_tokens = sum(len(r.token_ids) for r in results)
        ids = [f.request_id for f in short + long]
        worker_tokens = sum(int(s.request_stats(i)["output_tokens"]) for i in ids)

        w, g = scrape(wport), scrape(gport)
        model = MODEL  # every request series carries it, histograms too
        assert value(w, "tokenwire_worker_requests_total", model=model, outcome="completed") == 16
        assert value(w, "tokenwire_worker_requests_total", model=model, outcome="cancelled") == 4
        assert value(w, "tokenwire_worker_prompt_tokens_total", model=model) == 4 * 4 + 16 * 3
        assert value(w, "tokenwire_worker_generated_tokens_total", model=model) == worker_tokens
        assert value(w, "tokenwire_worker_time_to_first_token_seconds_count", model=model) == 20
        assert value(w, "tokenwire_worker_inter_token_latency_seconds_count", model=model) > 0
        assert value(w, "tokenwire_worker_queue_time_seconds_count", model=model) == 20
        assert value(w, "tokenwire_worker_queue_time_seconds_bucket", model=model, le="+Inf") == 20
        assert value(w, "tokenwire_worker_active_requests") == 0
        assert value(w, "tokenwire_worker_kv_blocks_used") == 0

        assert value(g, "tokenwire_gateway_requests_total", model=model, outcome="completed") == 16
        assert value(g, "tokenwire_gateway_requests_total", model=model, outcome="cancelled") == 4
        assert value(g, "tokenwire_gateway_requests_total", model=model, outcome="error_invalid_request") == 1
        assert value(g, "tokenwire_gateway_generated_tokens_total", model=model) == sent_tokens
        assert value(g, "tokenwire_gateway_time_to_first_token_seconds_count", model=model) == 20
        assert value(g, "tokenwire_gateway_inter_token_latency_seconds_count", model=model) > 0
        assert value(g, "tokenwire_gateway_e2e_request_latency_seconds_count", model=model) == 21
        assert value(w, "tokenwire_worker_e2e_request_latency_seconds_count", model=model) == 20
        assert value(g, "tokenwire_gateway_queue_time_seconds_count", model=model) == 20  # the bad one never went out
        assert value(g, "tokenwire_gateway_client_cancels_total", model=model, how="cancel") == 4
        # No computed rates: those are rate() over the counters.
        assert not [n for n, _ in [*g, *w] if "per_second" in n or "_rate" in n]
        assert value(g, "tokenwire_gateway_requests_in_flight") == 0
    finally:
        s.close()
