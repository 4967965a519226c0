"""A client pointed at no gateway fails within its stated bound, naming the
addresses it tried, rather than retrying forever; the CLI honours --timeout."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from clients.client import Client, GatewayUnavailableError
from tests.procs import REPO, free_port


def test_no_gateway_fails_within_the_bound_naming_the_addresses():
    addresses = [f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"]
    # 2 attempts of 0.5 s at each of 2 addresses: 2 s.
    with Client(addresses, connect_timeout_s=0.5, connect_attempts=2) as client:
        start = time.monotonic()
        with pytest.raises(GatewayUnavailableError) as e:
            client.generate("hello", max_tokens=4, timeout=30)
        took = time.monotonic() - start
        assert 1.5 < took < 3.5, took
        for a in addresses:
            assert a in str(e.value)
        assert "tokenwire gateway" in str(e.value)
        # Until a gateway answers, a new request fails at once.
        start = time.monotonic()
        with pytest.raises(GatewayUnavailableError):
            client.generate("again", max_tokens=4, timeout=30)
        assert time.monotonic() - start < 0.5


def test_cli_stream_honours_timeout():
    address = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "clients.cli", "generate", "hi", "--gateway", address, "--stream", "--timeout", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    took = time.monotonic() - start
    assert run.returncode == 1, run.stderr
    # Far under the 300 s default; the margin is the interpreter's start, seconds on a loaded machine.
    assert took < 20.0, took
    assert "Traceback" not in run.stderr
    assert "error:" in run.stderr
