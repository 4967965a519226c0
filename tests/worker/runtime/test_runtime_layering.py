"""worker/runtime runs on the GPU host: numpy, torch, safetensors, tokenizers only."""

from __future__ import annotations

import subprocess
import sys

from tests.procs import REPO


def test_the_runtime_imports_no_service_or_wire_package() -> None:
    code = "import sys, worker.runtime; print('\\n'.join(sys.modules))"
    loaded = {m.split(".")[0] for m in subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                                                      text=True, check=True).stdout.split()}
    for forbidden in ("zmq", "redis", "pydantic", "msgpack", "protocol", "clients", "gateway"):
        assert forbidden not in loaded, f"importing worker.runtime loads {forbidden}"
