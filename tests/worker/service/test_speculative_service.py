"""Speculative decoding through a worker process: the worker's default (--speculative)
and a Submit's own speculative_config give ordinary decoding's tokens, and the
acceptance shows in the Redis request record and on /metrics."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import protocol
from tests.integration.test_metrics import scrape, value
from tests.procs import REPO, Stack, free_port
from tests.worker.service.test_worker_service import FakeGateway, greedy_tokens


def test_worker_speculates_by_default_and_per_submit(long_model: Path, redis_server, tmp_path: Path) -> None:
    body = [40, 41, 42, 43, 44, 45, 46, 47]
    prompts = {"lookup": body + body + body[:3], "external": [7, 8, 9, 10], "off": body + body}
    expected = greedy_tokens(long_model, prompts, 24)

    s = Stack(long_model, redis_server.url, tmp_path)
    port = free_port()
    try:
        w = s.worker("--speculative", "prompt_lookup", "--num-draft-tokens", "4", "--metrics-port", str(port))
        w.wait_log("redis: connected")
        gw = FakeGateway.greeted(w.endpoint)
        specs = {
            "lookup": None,  # the worker's default
            # The expected continuation with one wrong token: accepted up to there, then verified token by token.
            "external": protocol.SpeculativeConfig(source="draft_tokens", num_draft_tokens=6,
                                                   draft_tokens=[*expected["external"][:9], 0, 0, 0]),
            "off": protocol.SpeculativeConfig(num_draft_tokens=0),
        }
        for name, prompt in prompts.items():
            gw.send(protocol.Submit(request_id=name, input_token_ids=prompt, max_tokens=24, end_id=-1,
                                    streaming=True, speculative_config=specs[name]))
        gw.recv_until(lambda: all(gw.final(name) for name in prompts))
        for name in prompts:
            assert gw.tokens(name) == expected[name], name
        records = {name: s.request_stats(name) for name in prompts}
        # Output token 0 comes with the prompt; drafts 1-6 are accepted with a bonus token 7, then 8.
        assert int(records["external"]["accepted_draft_tokens"]) >= 7
        assert int(records["lookup"]["draft_tokens"]) > 0
        assert "draft_tokens" not in records["off"]
        drafted = sum(int(r.get("draft_tokens", 0)) for r in records.values())
        accepted = sum(int(r.get("accepted_draft_tokens", 0)) for r in records.values())
        metrics = scrape(port)
        assert value(metrics, "tokenwire_worker_draft_tokens_total") == drafted
        assert value(metrics, "tokenwire_worker_accepted_draft_tokens_total") == accepted
        gw.close()
        # `tokenwire stats` shows the acceptance of the recent iterations.
        deadline = time.monotonic() + 10
        while "drafts accepted" not in (out := _stats(redis_server.url)):
            assert time.monotonic() < deadline, out
            time.sleep(0.2)
    finally:
        s.close()


def _stats(redis_url: str) -> str:
    return subprocess.run([sys.executable, "-m", "clients.cli", "stats", "--redis", redis_url, "--iterations", "50"],
                          cwd=REPO, capture_output=True, text=True, timeout=30, check=True).stdout
