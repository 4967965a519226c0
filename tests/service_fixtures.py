"""Checkpoints for the service tests (worker/service, gateway, clients, integration).

Each of those folders' conftest imports these fixtures; the checkpoints are
written once per session under pytest's base temp dir, whichever folder asks first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint
from tests.procs import long_context_checkpoint


@pytest.fixture(scope="session")
def service_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama, as a model the service serves under the name 'tiny-llama'."""
    path = tmp_path_factory.getbasetemp() / "service-models" / "tiny-llama"
    if not (path / "config.json").exists():
        make_checkpoint("llama_gqa", path)
    return path


@pytest.fixture(scope="session")
def long_model(service_model: Path) -> Path:
    """The same weights with an 8192-token context: requests that run for seconds."""
    path = service_model.parent / "tiny-llama-long"
    if not (path / "config.json").exists():
        long_context_checkpoint(service_model, path)
    return path
