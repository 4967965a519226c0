"""MAX_UTILIZATION through a worker process: on a KV cache that holds the requests'
prompts but not their whole lengths, sequences are preempted and recomputed, every
request still gets the tokens a roomy cache gives, and /metrics counts the preemptions."""

from __future__ import annotations

import time
from pathlib import Path

import protocol
from tests.integration.test_metrics import scrape, value
from tests.procs import Stack, free_port
from tests.worker.service.test_worker_service import FakeGateway, greedy_tokens


def test_worker_preempts_under_max_utilization_and_loses_no_token(long_model: Path, redis_server,
                                                                  tmp_path: Path) -> None:  # fmt: skip
    prompts = {f"r{i}": [11 + i, 12 + i, 13 + i] * 7 for i in range(3)}  # 21 tokens: one block of 32 each
    expected = greedy_tokens(long_model, prompts, 40)

    s = Stack(long_model, redis_server.url, tmp_path)
    port = free_port()
    try:
        # 3 blocks of 32 tokens: the three prompts at once, but each needs a second block past 32 tokens.
        w = s.worker("--scheduler-policy", "max_utilization", "--kv-tokens", "96", "--metrics-port", str(port))
        w.wait_log("redis: connected")
        gw = FakeGateway.greeted(w.endpoint)
        for name, prompt in prompts.items():
            gw.send(protocol.Submit(request_id=name, input_token_ids=prompt, max_tokens=40, end_id=-1, streaming=True))
        gw.recv_until(lambda: all(gw.final(name) for name in prompts))
        for name in prompts:
            assert gw.tokens(name) == expected[name], name
        deadline = time.monotonic() + 10  # iteration stats reach the worker in batches
        while value(scrape(port), "tokenwire_worker_preemptions_total") == 0:
            assert time.monotonic() < deadline, "no preemption counted"
            time.sleep(0.1)
        gw.close()
    finally:
        s.close()
