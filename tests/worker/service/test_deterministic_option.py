"""`tokenwire worker --deterministic` reaches the backend the engine builds; a
deterministic engine over several ranks is refused with a one-line reason."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint
from worker.service.__main__ import add_arguments
from worker.service.engine import EngineConfig, build_core


def test_deterministic_from_the_flag_to_the_backend(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).deterministic is False
    assert parser.parse_args(["--deterministic"]).deterministic is True

    ckpt = make_checkpoint("llama_gqa", tmp_path / "llama")
    config = EngineConfig(str(ckpt), 8, 512, 1, 1024, (), "numpy", None, "WARNING", "text")
    for flag in (False, True):
        core, _ = build_core(dataclasses.replace(config, deterministic=flag))
        assert core.backend.deterministic is flag  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="deterministic mode runs on one device"):
        build_core(dataclasses.replace(config, backend="torch", tensor_parallel_size=2, deterministic=True))
