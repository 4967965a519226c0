"""`tokenwire worker --scheduler-policy` reaches the executor the engine builds: on a KV
cache that holds two prompts but not two whole requests, GUARANTEED_NO_EVICT starts one
and MAX_UTILIZATION both."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from tests.checkpoints import make_checkpoint
from worker.executor import Request
from worker.service.__main__ import add_arguments
from worker.service.engine import EngineConfig, build_core


def test_scheduler_policy_from_the_flag_to_the_schedule(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).scheduler_policy == "guaranteed_no_evict"
    assert parser.parse_args(["--scheduler-policy", "max_utilization"]).scheduler_policy == "max_utilization"

    ckpt = make_checkpoint("llama_gqa", tmp_path / "llama")
    # 4 blocks of 32 tokens: two 40-token prompts (2 blocks each) fit; two of them at 40 + 80 tokens do not
    config = EngineConfig(str(ckpt), 8, 512, 1, 128, (), "numpy", None, "WARNING", "text")
    running = {}
    for policy in ("guaranteed_no_evict", "max_utilization"):
        core, _ = build_core(dataclasses.replace(config, scheduler_policy=policy))
        core.add_requests([(i, Request(input_token_ids=[5 + i] * 40, max_tokens=80)) for i in range(2)])
        core.step()
        running[policy] = len(core.scheduler.running)
    assert running == {"guaranteed_no_evict": 1, "max_utilization": 2}
