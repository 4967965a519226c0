"""The seed documents' own snippets run as tests, on a tiny checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama_gqa", tmp_path_factory.mktemp("seeds") / "llama")
