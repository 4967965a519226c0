"""Request migration with real processes (gateway/migration.py): a worker killed with
kill -9, its engine process killed, or its drain running out of time, mid-stream; every
started stream goes on through another worker and ends token for token as a run
without the fault (the workers run in deterministic mode, docs/deterministic.md)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from clients.client import Client, FinishReason, RequestError, RequestFuture, Speculation
from ops.process import spawned
from tests.procs import CLIENT_OPTIONS, HEARTBEAT_S, Stack, Worker, stack
from tests.worker.peft_adapters import make_adapter

TOKENS = 2000  # streams that run for seconds (the long model's context is 8192)
# Each kind of request a continuation carries on: every option it must resume exactly.
KINDS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 1.0, "top_p": 0.9, "seed": 8005},
    "penalties": {"temperature": 0.8, "seed": 3, "presence_penalty": 0.6, "frequency_penalty": 0.4,
                  "repetition_penalty": 1.3, "no_repeat_ngram_size": 3},
    "speculation": {"temperature": 0.0, "speculative": Speculation(num_draft_tokens=4)},
    "lora": {"temperature": 1.0, "seed": 11, "lora": "a"},
    # A JSON array too long to end before the fault.
    "guided json": {"temperature": 1.0, "seed": 5, "ignore_eos": False, "guided_json": {
        "type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 400}},
    # Its stop string is cut from the greedy stream's text, late enough to come after the fault.
    "stop string": {"temperature": 0.0},
}  # fmt: skip
PROMPTS = [[20 + i, 21, 22, 23, 24, 25, 26] for i in range(len(KINDS))]
PROMPTS[list(KINDS).index("stop string")] = PROMPTS[0]  # the greedy one's


@pytest.fixture(scope="module")
def adapter(service_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("peft")
    return make_adapter(service_model, tmp_path_factory.mktemp("migration-lora") / "a", r=4,
                        target_modules=["q_proj", "v_proj"], seed=1)  # fmt: skip


@pytest.fixture
def fleet(long_model: Path, redis_url: str, tmp_path: Path, adapter: Path) -> Callable[..., Any]:
    """`fleet(workers, *gateway_args, worker_args=())`: a stack of deterministic workers
    holding adapter `a` (made for the same weights), and one gateway."""

    @contextmanager
    def make(workers: int, *gateway_args: str, worker_args: tuple[str, ...] = ()) -> Iterator[Stack]:
        with stack(long_model, redis_url, tmp_path, workers=0, gateways=0) as s:
            for _ in range(workers):
                s.worker("--deterministic", "--lora", f"a={adapter}", *worker_args)
            s.gateway(*gateway_args).wait_workers(workers, timeout=60)
            yield s

    return make


def start_all(client: Client, stop: str) -> dict[str, RequestFuture]:
    pytest.importorskip("xgrammar", reason="the guided request needs the `guided` extra")
    return {
        name: client.stream(prompt, max_tokens=TOKENS, **{"ignore_eos": True, **opts},
                            stop=[stop] if name == "stop string" else [])
        for (name, opts), prompt in zip(KINDS.items(), PROMPTS, strict=True)
    }  # fmt: skip


class Followed:
    """Every stream followed on its own thread: tokens as they arrive, and the end."""

    def __init__(self, futures: dict[str, RequestFuture]) -> None:
        self.futures = futures
        self.tokens: dict[str, list[int]] = {name: [] for name in futures}
        self.texts: dict[str, str] = dict.fromkeys(futures, "")
        self.errors: dict[str, RequestError] = {}
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._follow, args=(n,), daemon=True) for n in futures]
        for t in self.threads:
            t.start()

    def _follow(self, name: str) -> None:
        try:
            for chunk in self.futures[name]:
                with self.lock:
                    self.tokens[name] += chunk.token_ids
                    self.texts[name] += chunk.text
        except RequestError as e:
            self.errors[name] = e

    def wait_tokens(self, at_least: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if all(len(t) >= at_least or self.futures[n].done() for n, t in self.tokens.items()):
                    return
            time.sleep(0.01)
        counts = {n: len(t) for n, t in self.tokens.items()}
        raise AssertionError(f"streams did not reach {at_least} tokens: {counts}")

    def running(self) -> int:
        return sum(not f.done() for f in self.futures.values())

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=120)


def busiest(s: Stack, among: list[Worker], running: Callable[[], int]) -> Worker:
    """The live worker running the most requests, once the heartbeats in Redis count all
    `running` streams. Heartbeats two intervals old at most: an older one may still show
    the requests of a run before."""
    time.sleep(2 * HEARTBEAT_S)
    assert running(), "every stream ended before the fault"
    deadline = time.monotonic() + 10
    while True:
        registered = [w for w in among if w.alive and s.redis.exists(s.keys.heartbeat(w.worker_id))]
        active = {w: s.load(w).num_active_requests for w in registered}
        if sum(active.values()) >= running() or time.monotonic() > deadline:
            return max(active, key=active.__getitem__)
        time.sleep(0.02)


def reference(s: Stack) -> tuple[dict[str, Any], str]:
    """Every kind of request run undisturbed, and the stop string of the "stop string" one."""
    with Client([s.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
        text = client.generate(PROMPTS[0], max_tokens=TOKENS, ignore_eos=True, temperature=0.0, timeout=120).text
        stop = text[int(len(text) * 0.6):][:12]
        assert stop.strip() and text.index(stop) > len(text) // 2, "no stop string late in the text"
        want = {name: f.result(timeout=120) for name, f in start_all(client, stop).items()}
    assert len(want["stop string"].token_ids) < TOKENS
    return want, stop


def assert_as_undisturbed(followed: Followed, want: dict[str, Any]) -> None:
    assert not followed.errors, followed.errors
    for name, future in followed.futures.items():
        got = future.result(timeout=0)
        assert got.token_ids == want[name].token_ids, f"{name}: tokens differ from the undisturbed run"
        assert got.text == want[name].text, name
        assert got.finish_reason == want[name].finish_reason, name
        assert followed.tokens[name] == got.token_ids, f"{name}: the stream's chunks repeat or miss tokens"
        assert followed.texts[name] == got.text, name


def kill_mid_stream(s: Stack, stop: str, kill: Callable[[Worker], None], *, twice: bool = False) -> Followed:
    with Client([s.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
        followed = Followed(start_all(client, stop))
        followed.wait_tokens(5)
        victim = busiest(s, s.workers, followed.running)
        kill(victim)
        if twice:
            s.gateways[0].wait_log("continued on another worker", timeout=30)
            survivors = [w for w in s.workers if w is not victim]
            followed.wait_tokens(10)
            kill(busiest(s, survivors, followed.running))
        followed.join()
    return followed


def test_kill_9_twice_mid_stream_every_stream_ends_as_undisturbed(fleet: Callable[..., Any]) -> None:
    with fleet(3) as s:
        want, stop = reference(s)
        followed = kill_mid_stream(s, stop, Worker.kill9, twice=True)
        assert_as_undisturbed(followed, want)
        log = s.gateways[0].log()
        assert log.count("continued on another worker") >= 2
        # Seen by the closed connection, not after the heartbeat bound.
        assert log.count("lost (its connection closed)") == 2


def test_the_engine_process_crashing_and_a_drain_timing_out_migrate_the_same_way(
        fleet: Callable[..., Any]) -> None:  # fmt: skip
    def crash_engine(worker: Worker) -> None:
        (engine,) = spawned(worker.process.pid)
        os.kill(engine, signal.SIGKILL)

    def drain(worker: Worker) -> None:  # its requests outlast its --drain-timeout
        worker.process.send_signal(signal.SIGTERM)

    with fleet(3, worker_args=("--drain-timeout", "0.2")) as s:
        want, stop = reference(s)
        assert_as_undisturbed(kill_mid_stream(s, stop, crash_engine), want)
        assert_as_undisturbed(kill_mid_stream(s, stop, drain), want)
        log = s.gateways[0].log()
        assert "worker failed" in log and "worker draining" in log


def test_the_migration_limit_ends_a_started_stream_with_one_clear_error(fleet: Callable[..., Any]) -> None:
    with fleet(2, "--migration-limit", "0") as s, Client([s.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
        futures = {i: client.stream(p, max_tokens=TOKENS, ignore_eos=True, temperature=0.0)
                   for i, p in enumerate(PROMPTS)}  # fmt: skip
        followed = Followed({str(i): f for i, f in futures.items()})
        followed.wait_tokens(3)
        victim = busiest(s, s.workers, followed.running)
        victim.kill9()
        followed.join()
        assert followed.errors, "no stream was on the killed worker"
        for error in followed.errors.values():
            assert error.code == "unavailable"
            assert f"worker {victim.worker_id} dropped this request" in error.message
            assert "the gateway's --migration-limit" in error.message, error.message


def test_a_request_cancelled_before_its_worker_died_is_not_moved(fleet: Callable[..., Any]) -> None:
    with fleet(2) as s, Client([s.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
        future = client.stream(PROMPTS[0], max_tokens=TOKENS, ignore_eos=True, temperature=0.0)
        next(iter(future))
        followed = Followed({"one": future})
        victim = busiest(s, s.workers, followed.running)
        victim.process.send_signal(signal.SIGSTOP)  # it cannot confirm the cancel
        future.cancel()
        time.sleep(0.5)  # the cancel reached the gateway
        victim.kill9()
        followed.join()
        result = future.result(timeout=30)
        assert result.finish_reason == FinishReason.CANCELLED
        assert "continued on another worker" not in s.gateways[0].log()
