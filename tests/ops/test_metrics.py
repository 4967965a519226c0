"""ops.metrics.BatchHistogram exposes what prometheus-client's own Histogram does
for the same values: the same bucket counts ("less or equal"), count and sum; the
worker's KV cache counters follow the engine's cumulative iteration records."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from ops.metrics import ITL_BUCKETS, BatchHistogram, WorkerMetrics
from protocol.stats import IterationStats


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("#") or "_created" in line:
            continue
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out


def test_batch_histogram_matches_prometheus_client_histogram() -> None:
    rng = random.Random(7)
    # Values on the bucket bounds too: a value equal to a bound counts in that bucket.
    values = [rng.choice([*ITL_BUCKETS, rng.uniform(0, 3)]) for _ in range(500)] + [9.0, 0.0]
    ours_registry, peer_registry = CollectorRegistry(), CollectorRegistry()
    ours = BatchHistogram("itl_seconds", "gap", ITL_BUCKETS, ours_registry)
    peer = Histogram("itl_seconds", "gap", ["model"], buckets=ITL_BUCKETS, registry=peer_registry)
    for start in range(0, len(values), 64):  # fed a delivery at a time
        ours.observe(values[start : start + 64], "m")
    for v in values:
        peer.labels("m").observe(v)
    ours_samples, peer_samples = _samples(ours_registry), _samples(peer_registry)
    assert ours_samples.keys() == peer_samples.keys()
    for name, value in peer_samples.items():
        assert abs(ours_samples[name] - value) < 1e-9, name
    assert ours_samples['itl_seconds_bucket{le="+Inf",model="m"}'] == len(values)


def test_batch_histogram_keeps_a_series_per_model() -> None:
    registry = CollectorRegistry()
    ours = BatchHistogram("itl_seconds", "gap", ITL_BUCKETS, registry)
    ours.observe([0.001, 0.002], "a")
    ours.observe([0.5], "b")
    samples = _samples(registry)
    assert samples['itl_seconds_count{model="a"}'] == 2
    assert samples['itl_seconds_count{model="b"}'] == 1
    assert samples['itl_seconds_bucket{le="0.001",model="a"}'] == 1


def test_worker_metrics_count_prefix_hits_by_tier_from_cumulative_iteration_records() -> None:
    metrics = WorkerMetrics()

    def record(reused: int, on_host: int, offloaded: int, cached: int) -> IterationStats:
        return IterationStats(timestamp=0.0, iter=1, iter_latency_ms=1.0, num_active_requests=0,
                              num_queued_requests=0, num_context_requests=0, num_generation_requests=0,
                              num_scheduled_tokens=0, max_num_blocks=8, free_num_blocks=8, used_num_blocks=0,
                              reused_blocks=reused, reused_host_blocks=on_host, offloaded_blocks=offloaded,
                              max_num_host_blocks=16, cached_num_host_blocks=cached)  # fmt: skip

    metrics.kv_cache(record(reused=5, on_host=2, offloaded=4, cached=4))
    metrics.kv_cache(record(reused=9, on_host=3, offloaded=6, cached=5))
    got = _samples(metrics.registry)
    assert got['tokenwire_worker_prefix_hit_blocks_total{tier="device"}'] == 6
    assert got['tokenwire_worker_prefix_hit_blocks_total{tier="host"}'] == 3
    assert got["tokenwire_worker_kv_offloaded_blocks_total"] == 6
    assert got["tokenwire_worker_kv_host_blocks_total"] == 16
    assert got["tokenwire_worker_kv_host_blocks_cached"] == 5
