"""Prometheus metrics of a worker and of a gateway, each in its own registry,
served on /metrics by prometheus-client's HTTP server (its own thread), and by
the gateway's HTTP front.

Counters and histograms are updated where the events happen (cheap, any thread);
gauges read the process's state when scraped. No gauge computes a rate: that is
`rate()` over the counters, in whatever window the reader wants. Every request
series (counts, tokens, latency histograms) has a `model` label.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import HistogramMetricFamily

import protocol
from protocol import stats

# Seconds. TTFT spans a queue wait and a prefill; inter-token latency is one decoding step.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
# One transfer's KV blocks read or written: a short prompt's in a millisecond, a long one's on a slow link in seconds.
KV_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


def outcome(response: protocol.Response) -> str:
    """How a final response ended: completed, cancelled or error."""
    if response.result is None:
        return "error"
    if protocol.FinishReason.CANCELLED in response.result.finish_reasons:
        return "cancelled"
    return "completed"


class BatchHistogram:
    """A Prometheus histogram fed a whole delivery's values at once, by model.

    prometheus-client's Histogram takes a lock and walks its buckets for each
    value, about 1 us; a worker streaming 64 requests observes 64 gaps per step,
    on the thread that shares the executor's GIL. One lock per batch here."""

    def __init__(self, name: str, documentation: str, buckets: Iterable[float], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = sorted(buckets)
        # By model: a count per bucket (the last: above every bound, +Inf), and the sum.
        self._by_model: dict[str, tuple[list[int], list[float]]] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, values: Iterable[float], model: str = "") -> None:
        bounds = self._bounds
        with self._lock:
            counts, total = self._by_model.get(model) or self._by_model.setdefault(
                model, ([0] * (len(bounds) + 1), [0.0]))
            for v in values:
                counts[bisect_left(bounds, v)] += 1  # buckets are "less or equal"
                total[0] += v

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            snapshot = [(model, list(counts), total[0]) for model, (counts, total) in self._by_model.items()]
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model"])
        for model, counts, total in snapshot:
            cumulative, running = [], 0
            for bound, n in zip([*map(str, self._bounds), "+Inf"], counts, strict=True):
                running += n
                cumulative.append((bound, running))
            family.add_metric([model], cumulative, total)
        yield family


class _Streams:
    """Per-request timing: TTFT from when it arrived, inter-token latency per chunk
    (the gap since the previous chunk over the tokens in it), end to end; each by
    the model `model_of` names for the request."""

    def __init__(self, ttft: BatchHistogram, itl: BatchHistogram, e2e: BatchHistogram, tokens: Counter,
                 model_of: Callable[[object], str]) -> None:  # fmt: skip
        self._ttft = ttft
        self._itl = itl
        self._e2e = e2e
        self._tokens = tokens
        self._model_of = model_of
        self._lock = threading.Lock()
        self._started: dict[object, float] = {}
        self._last: dict[object, float] = {}

    def start(self, key: object, at: float | None = None) -> None:
        with self._lock:
            self._started[key] = time.monotonic() if at is None else at

    def tokens(self, chunks: list[tuple[object, int]]) -> None:
        """(stream, new tokens) for each chunk of one delivery: taken together, so a
        batch of 64 streams costs one lock and one update per model, not 64."""
        now = time.monotonic()
        firsts: dict[str, list[float]] = {}
        gaps: dict[str, list[float]] = {}
        totals: dict[str, int] = {}
        model_of = self._model_of
        with self._lock:
            for key, n in chunks:
                if n <= 0:
                    continue
                model = model_of(key)
                totals[model] = totals.get(model, 0) + n
                last = self._last.get(key)
                self._last[key] = now
                if last is not None:
                    (gaps.get(model) or gaps.setdefault(model, [])).append((now - last) / n)
                elif (started := self._started.get(key)) is not None:
                    (firsts.get(model) or firsts.setdefault(model, [])).append(now - started)
        for model, total in totals.items():
            self._tokens.labels(model).inc(total)
        for model, values in gaps.items():
            self._itl.observe(values, model)
        for model, values in firsts.items():
            self._ttft.observe(values, model)

    def end(self, key: object, observe: bool = True) -> None:
        with self._lock:
            started = self._started.pop(key, None)
            self._last.pop(key, None)
        if observe and started is not None:
            self._e2e.observe([time.monotonic() - started], self._model_of(key))


class _Metrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        p = f"tokenwire_{role}"
        self.model = ""  # the worker's model: its requests' `model` label
        self.requests = Counter(f"{p}_requests", "Requests that ended, by model and outcome", ["model", "outcome"],
                                registry=r)  # fmt: skip
        self.generated_tokens = Counter(f"{p}_generated_tokens", "Output tokens streamed", ["model"], registry=r)
        self.ttft = BatchHistogram(f"{p}_time_to_first_token_seconds", "From a request's arrival to its first token",
                                   TTFT_BUCKETS, r)
        self.itl = BatchHistogram(f"{p}_inter_token_latency_seconds", "Gap between a stream's chunks, per token",
                                  ITL_BUCKETS, r)
        self.e2e = BatchHistogram(f"{p}_e2e_request_latency_seconds", "From a request's arrival to its end",
                                  E2E_BUCKETS, r)
        self.streams = _Streams(self.ttft, self.itl, self.e2e, self.generated_tokens, self.model_of)
        self.redis_connected = Gauge(f"{p}_redis_connected", "1 while Redis answers", registry=r)
        self.protocol_errors = Counter(f"{p}_protocol_errors",
                                       "Messages refused at the protocol boundary (malformed, over a limit, invalid)",
                                       registry=r)  # fmt: skip
        self._server: object = None

    def model_of(self, key: object) -> str:
        """The `model` label of a request's series."""
        return self.model

    def gauge(self, name: str, doc: str, read: Callable[[], float]) -> None:
        Gauge(name, doc, registry=self.registry).set_function(read)

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics on host:port, on a daemon thread."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)


class WorkerMetrics(_Metrics):
    def __init__(self) -> None:
        super().__init__("worker")
        self.prompt_tokens = Counter("tokenwire_worker_prompt_tokens", "Prompt tokens of requests taken", ["model"],
                                     registry=self.registry)  # fmt: skip
        self.queue_time = BatchHistogram("tokenwire_worker_queue_time_seconds",
                                         "From a request's arrival at the executor to its first scheduling",
                                         TTFT_BUCKETS, self.registry)  # fmt: skip
        # Speculative decoding, counted when a request ends: the acceptance rate is
        # rate(accepted) / rate(draft).
        self.draft_tokens = Counter("tokenwire_worker_draft_tokens", "Draft tokens verified (speculative decoding)",
                                    registry=self.registry)
        self.accepted_draft_tokens = Counter("tokenwire_worker_accepted_draft_tokens",
                                             "Draft tokens accepted (speculative decoding)", registry=self.registry)
        # Under --scheduler-policy max_utilization: how often a full KV cache cost a sequence its
        # cache (it recomputes its tokens later); always 0 under guaranteed_no_evict.
        self.preemptions = Counter("tokenwire_worker_preemptions",
                                   "Sequences preempted to make room in the KV cache (recomputed later)",
                                   registry=self.registry)  # fmt: skip
        # Disaggregated serving: KV transfers out (prefill workers) and in (decode workers).
        self.kv_transfers = Counter("tokenwire_worker_kv_transfers", "KV block transfers, by direction and outcome",
                                    ["direction", "outcome"], registry=self.registry)  # fmt: skip
        self.kv_transfer_bytes = Counter("tokenwire_worker_kv_transfer_bytes", "Bytes of KV blocks transferred",
                                         ["direction"], registry=self.registry)  # fmt: skip
        self.kv_transfer_time = Histogram("tokenwire_worker_kv_transfer_seconds",
                                          "Time to read (out) or write (in) one transfer's KV blocks", ["direction"],
                                          buckets=KV_TRANSFER_BUCKETS, registry=self.registry)  # fmt: skip

        # Prefix-cache hits by the tier that held the block (a host hit is a block copied back
        # to the device: a reload); the host tier's offloads, size and fill (--host-kv-cache-gb).
        self.prefix_hit_blocks = Counter("tokenwire_worker_prefix_hit_blocks",
                                         "Prompt blocks found in the KV cache, by the tier that held them "
                                         "(host: copied back to the device)", ["tier"],
                                         registry=self.registry)  # fmt: skip
        self.offloaded_blocks = Counter("tokenwire_worker_kv_offloaded_blocks",
                                        "KV blocks evicted from the device and copied to the host tier",
                                        registry=self.registry)  # fmt: skip
        self.host_blocks = Gauge("tokenwire_worker_kv_host_blocks_total", "KV cache host tier blocks",
                                 registry=self.registry)  # fmt: skip
        self.host_blocks_cached = Gauge("tokenwire_worker_kv_host_blocks_cached",
                                        "KV cache host tier blocks holding a cached block", registry=self.registry)
        self._kv_counted = (0, 0, 0)  # the cumulative (reused, reused on host, offloaded) already counted

    def watch(
        self,
        load: Callable[[], protocol.WorkerLoad],
        redis_connected: Callable[[], bool],
        gateways: Callable[[], int],
        draining: Callable[[], bool],
    ) -> None:
        self.gauge("tokenwire_worker_queued_requests", "Requests waiting to be scheduled",
                   lambda: load().num_queued_requests)
        self.gauge("tokenwire_worker_active_requests", "Requests being decoded", lambda: load().num_active_requests)
        self.gauge("tokenwire_worker_kv_blocks_total", "KV cache blocks", lambda: load().max_num_blocks)
        self.gauge("tokenwire_worker_kv_blocks_used", "KV cache blocks in use",
                   lambda: load().max_num_blocks - load().free_num_blocks)
        self.redis_connected.set_function(lambda: float(redis_connected()))
        self.gauge("tokenwire_worker_gateways_connected", "Gateways heard from within their heartbeat bound",
                   gateways)
        self.gauge("tokenwire_worker_draining", "1 once SIGTERM came and the worker drains",
                   lambda: float(draining()))

    def started(self, key: object, prompt_tokens: int, received_at: float) -> None:
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        self.streams.start(key, received_at)

    def queued(self, seconds: float) -> None:
        """A request that ran waited this long in the executor's queue."""
        self.queue_time.observe([seconds], self.model)

    def finished(self, key: object, how: str) -> None:
        self.requests.labels(self.model, how).inc()
        self.streams.end(key)

    def kv_transferred(self, direction: str, how: str, num_bytes: int = 0, seconds: float | None = None) -> None:
        self.kv_transfers.labels(direction, how).inc()
        if num_bytes:
            self.kv_transfer_bytes.labels(direction).inc(num_bytes)
        if seconds is not None:
            self.kv_transfer_time.labels(direction).observe(seconds)

    def preempted(self, sequences: int) -> None:
        if sequences:
            self.preemptions.inc(sequences)

    def speculated(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.draft_tokens.inc(drafted)
            self.accepted_draft_tokens.inc(accepted)

    def kv_cache(self, latest: stats.IterationStats) -> None:
        """Count the prefix hits and offloads of an engine's latest iteration record (its
        counts are cumulative over the engine's life)."""
        now = (latest.reused_blocks, latest.reused_host_blocks, latest.offloaded_blocks)
        reused, on_host, offloaded = (a - b for a, b in zip(now, self._kv_counted, strict=True))
        self._kv_counted = now
        if reused - on_host:
            self.prefix_hit_blocks.labels("device").inc(reused - on_host)
        if on_host:
            self.prefix_hit_blocks.labels("host").inc(on_host)
        if offloaded:
            self.offloaded_blocks.inc(offloaded)
        self.host_blocks.set(latest.max_num_host_blocks)
        self.host_blocks_cached.set(latest.cached_num_host_blocks)

    def rejected(self) -> None:
        """A request refused before it started (draining, a bad submit)."""
        self.requests.labels(self.model, "rejected").inc()


class GatewayMetrics(_Metrics):
    def __init__(self) -> None:
        super().__init__("gateway")
        self.queue_time = BatchHistogram("tokenwire_gateway_queue_time_seconds",
                                         "From a request's arrival to its dispatch to a worker", TTFT_BUCKETS,
                                         self.registry)  # fmt: skip
        self.client_cancels = Counter("tokenwire_gateway_client_cancels",
                                      "Requests their clients stopped, by model and how", ["model", "how"],
                                      registry=self.registry)  # fmt: skip
        # By API key name (never the key): what `tokenwire keys usage` reads from Redis, per gateway.
        self.api_key_requests = Counter("tokenwire_gateway_api_key_requests",
                                        "Requests served (HTTP and ZeroMQ), by API key", ["key"],
                                        registry=self.registry)  # fmt: skip
        self.api_key_tokens = Counter("tokenwire_gateway_api_key_tokens",
                                      "Tokens served by API key: in (prompt) and out (generated)", ["key", "direction"],
                                      registry=self.registry)  # fmt: skip
        self.api_key_refused = Counter("tokenwire_gateway_api_key_rate_limited",
                                       "Requests refused (429) for their API key's limits, by key and limit",
                                       ["key", "limit"], registry=self.registry)  # fmt: skip
        # A worker's prefix hit rate: rate(matched) / rate(prompt) of the requests routed to it.
        self.prefix_prompt_blocks = Counter("tokenwire_gateway_prefix_prompt_blocks",
                                            "Full prompt blocks of the requests routed to each worker",
                                            ["worker"], registry=self.registry)  # fmt: skip
        self.prefix_matched_blocks = Counter("tokenwire_gateway_prefix_matched_blocks",
                                             "Of those, the leading blocks the worker's KV cache held when routed",
                                             ["worker"], registry=self.registry)  # fmt: skip
        self.migrations = Counter("tokenwire_gateway_migrations",
                                  "Requests whose worker dropped them, by model and outcome: restarted (nothing "
                                  "received yet), continued (a continuation), limit (--migration-limit reached), "
                                  "not_resumable (started, and a continuation cannot carry it on)",
                                  ["model", "outcome"], registry=self.registry)  # fmt: skip
        self.prefix_index_blocks = Gauge("tokenwire_gateway_prefix_index_blocks",
                                         "Block hashes this gateway holds for each worker's KV cache", ["worker"],
                                         registry=self.registry)  # fmt: skip

    def watch(
        self,
        in_flight: Callable[[], int],
        waiting: Callable[[], int],
        workers: Callable[[str], int],
        clients: Callable[[], int],
        redis_connected: Callable[[], bool],
    ) -> None:
        self.gauge("tokenwire_gateway_requests_in_flight", "Requests accepted and not ended", in_flight)
        self.gauge("tokenwire_gateway_queued_requests", "Requests waiting for a worker", waiting)
        state = Gauge("tokenwire_gateway_workers", "Workers by connection state", ["state"], registry=self.registry)
        for name in ("ready", "draining", "connecting"):
            state.labels(name).set_function(functools.partial(workers, name))
        self.gauge("tokenwire_gateway_clients_connected", "Clients heard from within their heartbeat bound", clients)
        self.redis_connected.set_function(lambda: float(redis_connected()))

    def prefix_routed(self, worker: str, prompt_blocks: int, matched_blocks: int) -> None:
        self.prefix_prompt_blocks.labels(worker).inc(prompt_blocks)
        self.prefix_matched_blocks.labels(worker).inc(matched_blocks)

    def prefix_indexed(self, worker: str, blocks: int | None) -> None:
        """How many block hashes the worker's index holds; None: the worker is gone."""
        if blocks is None:
            with contextlib.suppress(KeyError):  # never indexed
                self.prefix_index_blocks.remove(worker)
        else:
            self.prefix_index_blocks.labels(worker).set(blocks)

    def model_of(self, key: object) -> str:
        """A gateway's request names its model once it is routed (see gateway.server._Request)."""
        return getattr(key, "model", None) or ""

    def accepted(self, key: object) -> None:
        self.streams.start(key)

    def dispatched(self, waited_s: float, model: str | None) -> None:
        self.queue_time.observe([waited_s], model or "")

    def migrated(self, key: object, outcome: str) -> None:
        self.migrations.labels(self.model_of(key), outcome).inc()

    def client_cancelled(self, key: object, how: str) -> None:
        """A client stopped a request: "cancel" (it said so), "gone" (it went silent) or
        "unread" (the gateway cut it off for leaving its messages unread)."""
        self.client_cancels.labels(self.model_of(key), how).inc()

    def ended(self, key: object, how: str | None) -> None:
        """A request's last message went out: `how` it ended (completed, cancelled,
        error, error_<code>); None: it ended unseen (its client went away). key None:
        refused before it was accepted. A key with a `model` names its model."""
        if how is not None:
            self.requests.labels(self.model_of(key), how).inc()
        if key is not None:
            self.streams.end(key, how is not None)
