"""ops.metrics.BatchHistogram exposes what prometheus-client's own Histogram does
for the same values: the same bucket counts ("less or equal"), count and sum."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from ops.metrics import ITL_BUCKETS, BatchHistogram


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
