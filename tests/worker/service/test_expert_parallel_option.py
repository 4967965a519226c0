"""`tokenwire worker --expert-parallel` reaches the executor's parallel config; on a model
with no experts it is refused with a one-line reason."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint
from worker.service.__main__ import add_arguments
from worker.service.engine import EngineConfig, build_core


def test_expert_parallel_from_the_flag_to_the_executor(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).expert_parallel is False
    assert parser.parse_args(["--expert-parallel", "--tensor-parallel-size", "2"]).expert_parallel is True

    moe = make_checkpoint("qwen3_moe_top1_sparse_step", tmp_path / "moe")
    config = EngineConfig(str(moe), 8, 512, 1, 1024, (), "torch", "cpu", "WARNING", "text", expert_parallel=True)
    core, _ = build_core(config)  # one rank: it holds every expert
    assert core.config.parallel_config.expert_parallel is True
    dense = make_checkpoint("llama_gqa", tmp_path / "llama")
    with pytest.raises(ValueError, match="expert parallelism needs a mixture-of-experts model"):
        build_core(dataclasses.replace(config, model=str(dense)))
