"""TensorRT-LLM's documented API snippets, run under tokenwire's names on a tiny checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama_gqa", tmp_path_factory.mktemp("trtllm_api") / "llama")
