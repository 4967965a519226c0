"""Fixtures shared by the worker tests: tiny random checkpoints, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoints import CHECKPOINTS, make_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> checkpoint directory, for every entry of tests.checkpoints.CHECKPOINTS."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return {name: make_checkpoint(name, root / name) for name in CHECKPOINTS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints: dict[str, Path]) -> Path:
    """The plain Llama (GQA, tied head): the one to use when any model will do."""
    return tiny_checkpoints["llama_gqa"]
