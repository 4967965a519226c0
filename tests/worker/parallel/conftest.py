"""Fixtures of the parallel tests: a model whose layers do not split evenly over two
pipeline stages."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def three_layer_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 with biases and 3 layers: two stages hold 2 and 1 (rank 0's, the last, the 1)."""
    return make_checkpoint("qwen2_bias", tmp_path_factory.mktemp("three_layers") / "qwen2_3l", num_hidden_layers=3)
