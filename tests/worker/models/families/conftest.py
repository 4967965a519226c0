from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoints import FAMILY_CHECKPOINTS, make_checkpoint


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> checkpoint directory, for every entry of tests.checkpoints.FAMILY_CHECKPOINTS."""
    root = tmp_path_factory.mktemp("family_checkpoints")
    return {name: make_checkpoint(name, root / name) for name in FAMILY_CHECKPOINTS}
