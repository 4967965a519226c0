"""Intake on its own: every request is checked and answered alone; the good ones
start, each under the caller's id, and a refused one takes no KV block."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoints import VOCAB_SIZE
from worker.executor import EngineCore, ExecutorConfig, KvCacheConfig, LoraConfig, Request, SpeculativeConfig
from worker.executor.block_manager import BlockManager
from worker.executor.intake import Intake
from worker.executor.lora_registry import LoraRegistry
from worker.executor.request_table import RequestTable
from worker.executor.scheduler import Scheduler
from worker.executor.siblings import Siblings


def make_intake(model: Path, num_blocks: int = 64) -> tuple[Intake, RequestTable, BlockManager]:
    config = ExecutorConfig(backend="numpy", kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=4096))
    core = EngineCore.from_model(model, config)  # for its backend and model config only
    blocks = BlockManager(num_blocks, 4, True)
    scheduler = Scheduler(config, blocks)
    table = RequestTable(scheduler)
    lora = LoraRegistry(core.backend, config, core.model_config).attach(scheduler)
    intake = Intake(config, core.model_config, core.max_seq_len, blocks, lora, {}, table,
                    Siblings(blocks, scheduler), tokenizer=None, has_draft_model=False)
    return intake, table, blocks


@pytest.mark.parametrize(
    ("request_kw", "message"),
    [
        (dict(input_token_ids=[1, VOCAB_SIZE]), "outside the vocabulary"),
        (dict(max_tokens=200), "KV cache blocks"),
        (dict(lora_config=LoraConfig(name="nope")), "unknown LoRA adapter 'nope'"),
        (dict(speculative_config=SpeculativeConfig(num_draft_tokens=99)), "num_draft_tokens must be in"),
        (dict(logits_post_processor_name="absent"), "absent"),
    ],
)
def test_a_bad_request_is_answered_with_its_problem_and_the_others_start(
        tiny_llama: Path, request_kw: dict, message: str) -> None:
    intake, table, blocks = make_intake(tiny_llama, num_blocks=16)
    good = Request(input_token_ids=[5, 6, 7], max_tokens=4, end_id=-1)
    intake.admit(1, good)
    intake.admit(2, Request(**(dict(input_token_ids=[5, 6, 7], max_tokens=4, end_id=-1) | request_kw)))
    intake.admit(3, good)
    out = table.take_output()
    assert [r.request_id for r in out.responses] == [2]
    assert message in (out.responses[0].error_msg or ""), out.responses[0].error_msg
    assert 1 in table and 3 in table and 2 not in table
    assert [s.request_id for s in table.scheduler.waiting] == [1, 3]
    assert blocks.num_free == blocks.num_blocks  # nothing allocated before a schedule


def test_an_id_in_flight_is_refused_and_the_first_request_keeps_it(tiny_llama: Path) -> None:
    intake, table, _ = make_intake(tiny_llama)
    first = Request(input_token_ids=[5, 6, 7], max_tokens=4, end_id=-1)
    intake.admit(7, first)
    intake.admit(7, Request(input_token_ids=[8], max_tokens=4, end_id=-1))
    (error,) = table.take_output().responses
    assert "request id 7 is already in flight" in (error.error_msg or "")
    entry = table.get(7)
    assert entry is not None and entry.request is first


def test_n_returned_sequences_are_made_at_intake_and_only_the_leader_queues(tiny_llama: Path) -> None:
    intake, table, _ = make_intake(tiny_llama)
    intake.admit(4, Request(input_token_ids=[5, 6, 7], max_tokens=4, end_id=-1, num_return_sequences=3))
    entry = table.get(4)
    assert entry is not None and [s.sequence_index for s in entry.seqs] == [0, 1, 2]
    assert table.scheduler.waiting == entry.seqs[:1]
