"""The worker process on its own, driven by a bare DEALER playing the gateway."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import msgpack
import pytest
import zmq

import protocol
from ops.process import spawned
from tests.procs import HEARTBEAT_S, MISSED, Stack
from tests.worker.service.processors import FORCED_TOKEN
from worker.executor import EngineCore, ExecutorConfig, Request


def greedy_tokens(model: Path, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """What each prompt's request streams from an in-process engine core on a roomy cache."""
    core = EngineCore.from_model(model, ExecutorConfig(backend="numpy"))
    core.add_requests((i, Request(input_token_ids=p, max_tokens=max_tokens, end_id=-1))
                      for i, p in enumerate(prompts.values()))  # fmt: skip
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while core.has_work:
        for r in core.step().all_responses():
            assert r.result is not None
            got[r.request_id] += r.result.output_token_ids[0]
    return dict(zip(prompts, got.values(), strict=True))


class FakeGateway:
    """Sends only what the test says: no automatic heartbeats."""

    @classmethod
    def greeted(cls, endpoint: str) -> FakeGateway:
        """One that has said Hello and heard the worker's Ready."""
        g = cls(endpoint)
        g.send(protocol.Hello(sender_id="fake-gw", role="gateway", heartbeat_interval_s=HEARTBEAT_S))
        g.recv_until(lambda: any(isinstance(m, protocol.Ready) for m in g.messages))
        return g

    def __init__(self, endpoint: str, name: str = "fake-gw") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, name.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.messages: list[protocol.Message] = []

    def send(self, msg: protocol.Message) -> None:
        self.sock.send(protocol.encode(msg))

    def recv_until(self, done, timeout: float = 20.0, heartbeat: bool = True) -> None:
        deadline = time.monotonic() + timeout
        next_beat = 0.0
        while not done():
            assert time.monotonic() < deadline, f"timed out; got {self.messages[-3:]}"
            if heartbeat and time.monotonic() > next_beat:
                self.send(protocol.Heartbeat(sender_id="fake-gw"))
                next_beat = time.monotonic() + HEARTBEAT_S
            if self.sock.poll(20):
                self.messages.append(protocol.decode(self.sock.recv()))

    def batches(self) -> list[protocol.ResultBatch]:
        return [m for m in self.messages if isinstance(m, protocol.ResultBatch)]

    def responses(self, request_id: str) -> list[protocol.Response]:
        return [r for b in self.batches() for r in b.all_responses() if r.request_id == request_id]

    def errors(self) -> list[protocol.ErrorReply]:
        return [m for m in self.messages if isinstance(m, protocol.ErrorReply)]

    def final(self, request_id: str) -> bool:
        return any(r.is_final for r in self.responses(request_id))

    def tokens(self, request_id: str) -> list[int]:
        """The request's streamed tokens (its first sequence)."""
        return [t for r in self.responses(request_id) if r.result is not None for t in r.result.output_token_ids[0]]

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def worker(long_model, redis_server, tmp_path_factory):
    s = Stack(long_model, redis_server.url, tmp_path_factory.mktemp("worker_service"))
    try:
        w = s.worker("--stats-stream-maxlen", "10", "--request-stats-ttl", "120", "--backend", "auto")
        w.wait_log("redis: connected")
        yield s, w
    finally:
        s.close()


@pytest.fixture
def gw(worker):
    g = FakeGateway.greeted(worker[1].endpoint)
    yield g
    g.close()


def test_ready_and_registry(worker, gw):
    s, w = worker
    (ready,) = [m for m in gw.messages if isinstance(m, protocol.Ready)]
    assert ready.models == ["tiny-llama-long"]
    assert ready.vocab_size == 320
    assert ready.max_seq_len == 8192
    assert ready.load is not None
    assert ready.load.free_num_blocks == ready.load.max_num_blocks > 0
    info = protocol.decode(s.redis.get(s.keys.worker(w.worker_id)))
    assert isinstance(info, protocol.WorkerInfo)
    assert info.address == w.endpoint
    assert info.models == ["tiny-llama-long"]
    assert info.max_batch_size == 64
    assert info.state == "serving"
    assert info.device == "numpy"  # what --backend auto chose on this CPU host
    assert 0 < s.redis.pttl(s.keys.worker(w.worker_id)) <= 3000
    assert s.redis.zscore(s.keys.workers(), w.worker_id) is not None


def test_results_coalesced_per_iteration_with_load(worker, gw):
    s, w = worker
    ids = [f"co-{i}" for i in range(8)]
    for i, rid in enumerate(ids):
        gw.send(protocol.Submit(request_id=rid, input_token_ids=[5, 6 + i], max_tokens=20, streaming=True))
    gw.recv_until(lambda: all(gw.final(r) for r in ids))
    batches = [b for b in gw.batches() if any(r.request_id in ids for r in b.all_responses())]
    assert all(b.load is not None for b in batches)
    assert max(len({r.request_id for r in b.all_responses()}) for b in batches) > 1, "one message, many requests"
    # Plain streamed steps travel in columns; the final responses whole.
    assert sum(len(b.streamed.request_ids) for b in batches if b.streamed is not None) >= 8 * 18
    assert all(r.is_final for b in batches for r in b.responses if r.request_id in ids)
    for rid in ids:
        tokens = [t for r in gw.responses(rid) for t in r.result.output_token_ids[0]]
        assert len(tokens) == 20
        assert sum(r.is_final for r in gw.responses(rid)) == 1
    stats = s.request_stats(ids[0])
    assert stats["gateway"] == "fake-gw"
    assert stats["worker"] == w.worker_id
    assert stats["prompt_tokens"] == "2"
    assert stats["output_tokens"] == "20"
    assert stats["finish_reason"] == "length"
    for field in ("queue_time_ms", "ttft_ms", "e2e_ms"):
        assert float(stats[field]) >= 0
    assert 0 < s.redis.ttl(s.keys.request_stats(ids[0])) <= 120
    # The iteration stream exists and is capped (Redis trims approximately, in nodes of 100).
    stream = s.keys.iteration_stats(w.worker_id)
    deadline = time.monotonic() + 5  # they reach Redis in batches, a fraction of a second behind
    while not s.redis.xlen(stream):
        assert time.monotonic() < deadline, "no iteration stats in Redis"
        time.sleep(0.05)
    assert s.redis.xlen(stream) <= 10 + 100
    s.wait_idle(w)


def test_a_burst_with_a_cancel_and_a_repeated_id(worker, gw):
    # Sent back to back, so the worker likely reads them in one socket turn, whose
    # submits it enqueues together: a cancel or a repeat in that turn must still count.
    # The repeat names the long request, which runs until its cancel however the
    # burst is split into turns (a short one may have ended before its repeat is read).
    s, w = worker
    long = protocol.SamplingConfig(min_tokens=6000)
    for i in range(6):
        gw.send(protocol.Submit(request_id=f"b{i}", input_token_ids=[5, 6 + i], max_tokens=8, streaming=True))
    gw.send(protocol.Submit(request_id="b-cut", input_token_ids=[5, 6], max_tokens=6000, sampling_config=long))
    gw.send(protocol.Submit(request_id="b-cut", input_token_ids=[5, 7], max_tokens=8))
    gw.send(protocol.Cancel(request_id="b-cut"))
    gw.recv_until(lambda: all(gw.final(f"b{i}") for i in range(6)) and gw.final("b-cut") and bool(gw.errors()))
    (cut,) = gw.responses("b-cut")
    assert cut.result is not None and cut.result.finish_reasons == [protocol.FinishReason.CANCELLED]
    (repeat,) = gw.errors()
    assert repeat.request_id == "b-cut"
    assert repeat.message == "request_id 'b-cut' is already running"
    for i in range(6):
        assert sum(len(r.result.output_token_ids[0]) for r in gw.responses(f"b{i}")) == 8
    s.wait_idle(w)


def test_in_band_cancel(worker, gw):
    s, w = worker
    gw.send(protocol.Submit(request_id="c1", input_token_ids=[5, 6], max_tokens=6000, streaming=True,
                            sampling_config=protocol.SamplingConfig(min_tokens=6000)))  # fmt: skip
    gw.recv_until(lambda: bool(gw.responses("c1")))
    gw.send(protocol.Cancel(request_id="c1"))
    gw.recv_until(lambda: gw.final("c1"))
    assert gw.responses("c1")[-1].result.finish_reasons == [protocol.FinishReason.CANCELLED]
    s.wait_idle(w)


def test_silent_gateway_requests_are_aborted(worker):
    s, w = worker
    g = FakeGateway(w.endpoint, name="silent-gw")
    try:
        g.send(protocol.Submit(request_id="orphan", input_token_ids=[5, 6], max_tokens=6000, streaming=True,
                               sampling_config=protocol.SamplingConfig(min_tokens=6000)))  # fmt: skip
        g.recv_until(lambda: bool(g.responses("orphan")), heartbeat=False)
        # No heartbeat from here on: after MISSED intervals the worker gives up on us.
        stats = s.request_stats("orphan", timeout=MISSED * HEARTBEAT_S + 5)
        assert stats["finish_reason"] == "cancelled"
        assert int(stats["output_tokens"]) < 6000
        s.wait_idle(w)
        assert "silent-gw" in w.log()
    finally:
        g.close()


def test_bad_messages_get_errors(worker, gw):
    gw.sock.send(b"\xc1 not msgpack")
    gw.send(protocol.Submit(request_id="text", prompt="hello", max_tokens=3))
    gw.send(protocol.Submit(request_id="other-model", input_token_ids=[5], max_tokens=3, model="gpt-9"))
    gw.send(protocol.Submit(request_id="oov", input_token_ids=[5, 4000], max_tokens=3))
    gw.recv_until(lambda: len(gw.errors()) >= 3 and bool(gw.responses("oov")))
    by_id = {e.request_id: e for e in gw.errors()}
    assert by_id[None].code == protocol.ErrorCode.PROTOCOL
    assert "gateway" in by_id["text"].message
    assert by_id["other-model"].code == protocol.ErrorCode.UNKNOWN_MODEL
    (oov,) = gw.responses("oov")
    assert oov.error_msg is not None
    assert "4000" in oov.error_msg


def test_a_submit_batch_runs_each_submit_and_refuses_bad_ones_alone(worker, gw):
    s, w = worker
    (ready,) = [m for m in gw.messages if isinstance(m, protocol.Ready)]
    assert ready.submit_batches
    long = protocol.SamplingConfig(min_tokens=6000)
    items = [protocol.encode(protocol.Submit(request_id=f"sb{i}", input_token_ids=[5, 6 + i], max_tokens=8))
             for i in range(3)]  # fmt: skip
    items.append(protocol.encode(protocol.Submit(request_id="sb-cut", input_token_ids=[5, 6], max_tokens=6000,
                                                 sampling_config=long)))  # fmt: skip
    items.append(msgpack.packb([1, "submit", {"request_id": "sb-bad", "input_token_ids": [5], "max_tokens": 0}]))
    items.append(protocol.encode(protocol.Cancel(request_id="sb0")))  # not a submit: refused, not applied
    gw.send(protocol.SubmitBatch(submits=items))
    gw.send(protocol.Cancel(request_id="sb-cut"))  # after the batch: its submit is enqueued first
    gw.recv_until(lambda: all(gw.final(f"sb{i}") for i in range(3)) and gw.final("sb-cut") and len(gw.errors()) >= 2)
    for i in range(3):
        assert len(gw.tokens(f"sb{i}")) == 8
    assert gw.responses("sb-cut")[-1].result.finish_reasons == [protocol.FinishReason.CANCELLED]
    by_id = {e.request_id: e for e in gw.errors()}
    assert by_id["sb-bad"].code == protocol.ErrorCode.PROTOCOL and "max_tokens" in by_id["sb-bad"].message
    assert by_id[None].message == "a submits message carries submit messages only, not cancel"
    s.wait_idle(w)


def test_echo_backend_is_a_transport_test_worker(service_model, redis_server, tmp_path):
    s = Stack(service_model, redis_server.url, tmp_path)
    try:
        w = s.worker("--backend", "echo")
        g = FakeGateway(w.endpoint)
        g.send(protocol.Submit(request_id="e", input_token_ids=[5, 6, 77], max_tokens=50, streaming=True))
        g.recv_until(lambda: g.final("e"))
        tokens = [t for r in g.responses("e") for t in r.result.output_token_ids[0]]  # type: ignore[union-attr]
        assert tokens == [77] * 50
        # Top log probs too (the OpenAI API's `logprobs`): the echoed token first.
        g.send(protocol.Submit(request_id="lp", input_token_ids=[5, 6, 77], max_tokens=5, streaming=True,
                               output_config=protocol.OutputConfig(top_n_log_probs=3)))
        g.recv_until(lambda: g.final("lp"))
        top = [t for r in g.responses("lp") for t in r.result.top_token_ids[0]]  # type: ignore[union-attr,index]
        assert [t[0] for t in top] == [77] * 5 and all(len(t) == 3 for t in top)
        assert "TRANSPORT TEST ONLY" in w.log()
        g.close()
    finally:
        s.close()


def test_logits_post_processors_are_configured_by_import_path(service_model, redis_server, tmp_path):
    s = Stack(service_model, redis_server.url, tmp_path)
    try:
        w = s.worker("--logits-post-processor", "force=tests.worker.service.processors:force_token")
        g = FakeGateway(w.endpoint)
        g.send(protocol.Submit(request_id="forced", input_token_ids=[5, 6], max_tokens=6, end_id=-1,
                               logits_post_processor_name="force"))
        g.send(protocol.Submit(request_id="free", input_token_ids=[5, 6], max_tokens=6, end_id=-1))
        g.send(protocol.Submit(request_id="unknown", input_token_ids=[5, 6], max_tokens=6,
                               logits_post_processor_name="nope"))
        g.recv_until(lambda: all(g.final(r) or any(x.error_msg for x in g.responses(r))
                                 for r in ("forced", "free", "unknown")))
        (forced,) = g.responses("forced")
        assert forced.result is not None and forced.result.output_token_ids[0] == [FORCED_TOKEN] * 6
        (free,) = g.responses("free")
        assert free.result is not None and free.result.output_token_ids[0] != [FORCED_TOKEN] * 6
        (unknown,) = g.responses("unknown")
        assert unknown.error_msg is not None and "nope" in unknown.error_msg
        g.close()
    finally:
        s.close()


def test_a_dead_engine_ends_its_requests_and_the_worker(long_model, redis_server, tmp_path):
    """The engine process killed under a stream: the gateway gets an error naming it
    for each request in flight, and the worker exits non-zero (systemd restarts it)."""
    s = Stack(long_model, redis_server.url, tmp_path)
    try:
        w = s.worker()
        g = FakeGateway(w.endpoint)
        g.send(protocol.Submit(request_id="doomed", input_token_ids=[5, 6], max_tokens=6000, streaming=True,
                               sampling_config=protocol.SamplingConfig(min_tokens=6000)))  # fmt: skip
        g.recv_until(lambda: bool(g.responses("doomed")))
        pid = w.process.pid
        (engine_pid,) = spawned(pid)
        os.kill(engine_pid, signal.SIGKILL)
        g.recv_until(lambda: bool(g.errors()))
        (error,) = g.errors()
        assert error.request_id == "doomed" and error.code == protocol.ErrorCode.INTERNAL
        assert "engine process ended" in error.message
        assert w.process.wait(timeout=10) == 1
        g.close()
    finally:
        s.close()


def test_an_invalid_guide_on_a_fresh_worker_fails_alone(service_model, redis_server, tmp_path):
    """The first guided request of a fresh worker, with a regex that does not compile, gets its error, and the
    engine keeps serving (it used to die looking up the refused request's id)."""
    pytest.importorskip("xgrammar")
    s = Stack(service_model, redis_server.url, tmp_path)
    try:
        w = s.worker()
        g = FakeGateway(w.endpoint)
        g.send(protocol.Submit(request_id="bad", input_token_ids=[5, 6], max_tokens=4,
                               guided_decoding_params=protocol.GuidedDecodingParams(guide_type="regex", guide="(")))
        g.send(protocol.Submit(request_id="good", input_token_ids=[5, 6], max_tokens=4, end_id=-1))
        g.recv_until(lambda: g.final("good") and any(r.error_msg for r in g.responses("bad")))
        (bad,) = g.responses("bad")
        assert bad.error_msg is not None and "regex" in bad.error_msg.lower()
        g.send(protocol.Submit(request_id="after", input_token_ids=[7, 8], max_tokens=3, end_id=-1))
        g.recv_until(lambda: g.final("after"))
        assert w.process.poll() is None
        g.close()
    finally:
        s.close()
