"""worker/runtime runs on the GPU host: numpy, torch, safetensors, tokenizers only."""

from __future__ import annotations

import subprocess
import sys

from tests.procs import REPO

# protocol's pure-data modules (standard library only): the options' one declaration,
# finish reasons and request states, the stats, the vocabulary and context rules, the block
# hashes, which requests a continuation can carry.
PURE_PROTOCOL = {"protocol", "protocol.options", "protocol.status", "protocol.stats", "protocol.model_fit",
                 "protocol.block_hash", "protocol.continuation"}


def test_the_runtime_imports_no_service_or_wire_package() -> None:
    code = "import sys, worker.runtime; print('\\n'.join(sys.modules))"
    modules = set(subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout.split())
    loaded = {m.split(".")[0] for m in modules}
    for forbidden in ("zmq", "redis", "pydantic", "msgpack", "clients", "gateway"):
        assert forbidden not in loaded, f"importing worker.runtime loads {forbidden}"
    wire = {m for m in modules if m.split(".")[0] == "protocol"} - PURE_PROTOCOL
    assert not wire, f"importing worker.runtime loads {sorted(wire)}"
