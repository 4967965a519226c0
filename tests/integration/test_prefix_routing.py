"""Multi-turn conversations through a gateway and two workers: each follow-up turn goes
to the worker whose KV cache holds the conversation, unless that worker is far busier
than the other; a restarted worker's entry in the gateway's index starts empty."""

from __future__ import annotations

import random
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import protocol
from tests.integration.wire import WireClient
from tests.procs import Stack, Worker, free_port

SYSTEM_TOKENS = 100  # over three 32-token KV blocks: a follow-up turn shares them and more
USER_TOKENS = 20
OUTPUT_TOKENS = 8


def index_blocks(port: int) -> dict[str, float]:
    """The gateway's per-worker index sizes, from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.labels["worker"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "tokenwire_gateway_prefix_index_blocks"}  # fmt: skip


class Conversations:
    """Chats of token ids: each turn's prompt is the last one, its answer and new user tokens."""

    def __init__(self, client: WireClient, stack: Stack, count: int) -> None:
        rng = random.Random(3)
        self.client, self.stack, self.rng = client, stack, rng
        self.prompts = [[rng.randrange(5, 320) for _ in range(SYSTEM_TOKENS)] for _ in range(count)]
        self.turns = [0] * count

    def send(self, conv: int) -> str:
        self.turns[conv] += 1
        rid = f"conv{conv}-turn{self.turns[conv]}"
        self.prompts[conv] += [self.rng.randrange(5, 320) for _ in range(USER_TOKENS)]
        self.client.send(protocol.Submit(request_id=rid, input_token_ids=self.prompts[conv], max_tokens=OUTPUT_TOKENS))
        return rid

    def finish(self, conv: int, rid: str) -> str:
        """Wait for the turn; its answer joins the conversation. Which worker served it."""
        self.client.wait([rid], timeout=60)
        assert not self.client.errors.get(rid), self.client.errors[rid]
        self.prompts[conv] += [t for r in self.client.responses[rid] if r.result for t in r.result.output_token_ids[0]]
        return self.stack.request_stats(rid)["worker"]


@pytest.fixture
def fleet(long_model, redis_url, tmp_path):
    s = Stack(long_model, redis_url, tmp_path)
    port = free_port()
    try:
        s.worker()
        s.worker()
        s.gateway("--metrics-port", str(port))
        s.gateways[0].wait_workers(2)
        client = WireClient(s.gateways[0].endpoint)
        client.hello()
        yield s, client, port
        client.close()
    finally:
        s.close()


def test_follow_up_turns_go_to_the_worker_holding_the_conversation(fleet) -> None:
    s, client, _ = fleet
    chats = Conversations(client, s, 6)
    first = [chats.send(c) for c in range(6)]  # at once: the least loaded worker in turn takes each
    home = [chats.finish(c, rid) for c, rid in enumerate(first)]
    assert set(home) == {"worker0", "worker1"}, home
    for _ in range(3):
        for c in range(6):
            assert chats.finish(c, chats.send(c)) == home[c], f"conversation {c} turn {chats.turns[c]} left home"


def test_a_worker_far_busier_than_the_other_spills_its_conversations_over(fleet) -> None:
    s, client, _ = fleet
    chats = Conversations(client, s, 2)
    home = [chats.finish(c, rid) for c, rid in enumerate([chats.send(0), chats.send(1)])]
    busy = s.workers[0] if home[0] == "worker0" else s.workers[1]
    # Another gateway keeps conversation 0's worker busy with long requests.
    other = WireClient(busy.endpoint)
    try:
        other.send(protocol.Hello(sender_id="other-gw", role="gateway", heartbeat_interval_s=1.0))
        hogs = [f"hog-{i}" for i in range(16)]
        for rid in hogs:
            other.send(protocol.Submit(request_id=rid, input_token_ids=[5, 6, 7], max_tokens=4000, end_id=-1))
        deadline = time.monotonic() + 30
        while (lambda load: load.num_active_requests + load.num_queued_requests)(s.load(busy)) < 16:
            assert time.monotonic() < deadline, "the worker never reported the load"
            other.pump(0.1)
        time.sleep(1.0)  # a few of its heartbeats reach the gateway
        assert chats.finish(0, chats.send(0)) != home[0]  # spilled over
        for rid in hogs:
            other.send(protocol.Cancel(request_id=rid))
        other.wait(hogs, timeout=60)
    finally:
        other.close()


def test_a_restarted_worker_starts_with_an_empty_index_entry(fleet) -> None:
    s, client, port = fleet
    chats = Conversations(client, s, 4)
    first = [chats.send(c) for c in range(4)]
    for c, rid in enumerate(first):
        chats.finish(c, rid)
    deadline = time.monotonic() + 10
    while min(index_blocks(port).get(w, 0) for w in ("worker0", "worker1")) == 0:
        assert time.monotonic() < deadline, f"the index never filled: {index_blocks(port)}"
        time.sleep(0.1)
    old = s.workers[0]
    old.kill9()
    again = Worker("worker0-again", s.model, s.redis_url, s.log_dir, "--worker-id", "worker0", "--bind", old.endpoint)
    s.workers.append(again)
    again.wait_log("redis: connected")
    # Back within the gateway's heartbeat bound, it keeps its link and learns of the restart from a
    # snapshot under the worker's new incarnation; later, it reconnects and gets one after Ready.
    deadline = time.monotonic() + 30
    while index_blocks(port).get("worker0") != 0:
        assert time.monotonic() < deadline, f"worker0's entry not emptied: {index_blocks(port)}"
        time.sleep(0.1)
    assert index_blocks(port)["worker1"] > 0
