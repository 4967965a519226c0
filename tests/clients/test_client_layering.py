"""What the client library and the gateway may pull in (DESIGN.md §2), checked in
a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

from tests.procs import REPO


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return {name.split(".")[0] if not name.startswith("worker.") else name for name in done.stdout.split()}


def test_client_library_needs_only_zmq_msgpack_pydantic():
    loaded = _loaded_after("import clients.client, clients.async_client")
    for heavy in ("numpy", "redis", "tokenizers", "torch", "worker", "gateway"):
        assert heavy not in loaded, f"importing the client library loads {heavy}"
    assert not any(name.startswith("worker.") for name in loaded)


def test_gateway_never_imports_the_executor():
    loaded = _loaded_after("import gateway.server, gateway.__main__")
    assert not any(name.startswith("worker.executor") for name in loaded)
    assert "torch" not in loaded


def test_the_user_facing_types_need_nothing():
    code = "import sys, clients.params; print('\\n'.join(sys.modules))"
    modules = set(subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout.split())
    loaded = {m.split(".")[0] for m in modules}
    for heavy in ("zmq", "redis", "pydantic", "msgpack", "numpy", "tokenizers", "worker", "gateway"):
        assert heavy not in loaded, f"importing clients.params loads {heavy}"
    # protocol's options are declared once, in a module that needs nothing either
    assert {m for m in modules if m.split(".")[0] == "protocol"} == {"protocol", "protocol.options"}
