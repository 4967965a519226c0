"""ops.curve with real ZeroMQ sockets over TCP: a CURVE server accepts the allowed
keys and refuses, with a logged reason, a peer without CURVE, a peer with an
unknown key, a peer that expects another server key, and an identity takeover."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from ops import curve


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("curve")
    for name in ("server", "client", "other", "stranger"):
        curve.generate(root / "pairs", name)
    allowed = root / "allowed"
    allowed.mkdir()
    for name in ("client", "other"):
        (allowed / f"{name}.key").write_bytes((root / "pairs" / f"{name}.key").read_bytes())
    return root


@pytest.fixture
def server(keys: Path) -> Iterator[tuple[zmq.Socket, str]]:
    ctx = zmq.Context()
    pair = curve.load_keypair(keys / "pairs" / "server.key_secret")
    side = curve.CurveServer("test-server", pair, curve.load_public_keys(keys / "allowed"))
    side.start(ctx)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)
    side.serve(router)
    router.bind("tcp://127.0.0.1:*")
    yield router, router.getsockopt_string(zmq.LAST_ENDPOINT)
    router.close(0)
    side.stop()
    ctx.term()


def _client(ctx: zmq.Context, endpoint: str, keys: Path, name: str | None, server_name: str = "server",
            identity: bytes = b"") -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    if name is not None:
        curve.connect_as_client(
            sock,
            curve.load_keypair(keys / "pairs" / f"{name}.key_secret"),
            curve.load_public_key(keys / "pairs" / f"{server_name}.key"),
        )
    sock.connect(endpoint)
    return sock


def _received(router: zmq.Socket, timeout_ms: int = 1000) -> list[zmq.Frame] | None:
    if not router.poll(timeout_ms):
        return None
    return router.recv_multipart(copy=False)


def _wait_for(caplog: pytest.LogCaptureFixture, text: str, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(text in r.getMessage() for r in caplog.records):
            return
        time.sleep(0.05)
    raise AssertionError(f"no log line with {text!r}: {[r.getMessage() for r in caplog.records]}")


def test_an_allowed_client_talks_and_its_key_is_on_its_frames(server: tuple[zmq.Socket, str], keys: Path) -> None:
    router, endpoint = server
    ctx = zmq.Context()
    sock = _client(ctx, endpoint, keys, "client")
    sock.send(b"hello")
    frames = _received(router)
    assert frames is not None and frames[1].bytes == b"hello"
    assert frames[1].get("User-Id") == curve.load_public_key(keys / "pairs" / "client.key").decode()
    router.send_multipart([frames[0].bytes, b"back"])
    assert sock.poll(1000) and sock.recv() == b"back"
    sock.close(0)
    ctx.term()


@pytest.mark.parametrize(
    ("name", "server_name", "logged"),
    [
        (None, "server", "refused a peer"),  # no CURVE at all
        ("stranger", "server", "unknown public key"),  # a key not on the allow list
        ("client", "other", "refused a peer"),  # expects another server: a fake server key
    ],
)
def test_a_refused_peer_gets_nothing_through_and_is_logged(
    server: tuple[zmq.Socket, str], keys: Path, caplog: pytest.LogCaptureFixture,
    name: str | None, server_name: str, logged: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="tokenwire.curve")
    router, endpoint = server
    ctx = zmq.Context()
    sock = _client(ctx, endpoint, keys, name, server_name)
    sock.send(b"let me in")
    _wait_for(caplog, logged)
    assert _received(router, 300) is None
    good = _client(ctx, endpoint, keys, "client")  # authenticated traffic still flows
    good.send(b"hello")
    frames = _received(router)
    assert frames is not None and frames[1].bytes == b"hello"
    sock.close(0)
    good.close(0)
    ctx.term()


def test_an_identity_takeover_by_another_key_is_refused(
    server: tuple[zmq.Socket, str], keys: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tokenwire.curve")
    router, endpoint = server
    bound = curve.IdentityKeys("test-server", curve=True)
    ctx = zmq.Context()
    first = _client(ctx, endpoint, keys, "client", identity=b"gw-1")
    first.send(b"mine")
    frames = _received(router)
    assert frames is not None and bound.admit(frames[0].bytes, frames[1])
    thief = _client(ctx, endpoint, keys, "other", identity=b"gw-1")  # allowed key, someone else's identity
    thief.send(b"now mine")
    frames = _received(router)
    assert frames is not None and frames[1].bytes == b"now mine"
    assert not bound.admit(frames[0].bytes, frames[1])
    _wait_for(caplog, "refused an identity takeover")
    again = _client(ctx, endpoint, keys, "client", identity=b"gw-1")  # the owner reconnecting is fine
    again.send(b"back")
    frames = _received(router)
    assert frames is not None and bound.admit(frames[0].bytes, frames[1])
    for sock in (first, thief, again):
        sock.close(0)
    ctx.term()


def test_a_peer_taking_a_secret_identitys_name_is_refused_while_the_owner_is_connected(
    server: tuple[zmq.Socket, str], keys: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tokenwire.curve")
    router, endpoint = server
    bound = curve.IdentityKeys("test-server", curve=True)
    ctx = zmq.Context()
    owner_id = curve.routing_id("gw-1")
    assert curve.identity_name(owner_id) == b"gw-1" and owner_id != curve.routing_id("gw-1")
    owner = _client(ctx, endpoint, keys, "client", identity=owner_id)
    owner.send(b"mine")
    frames = _received(router)
    assert frames is not None and frames[0].bytes == owner_id and bound.admit(frames[0].bytes, frames[1])
    for identity in (b"gw-1", b"gw-1\0guess"):  # the name alone, or with a guessed secret
        thief = _client(ctx, endpoint, keys, "other", identity=identity)
        thief.send(b"now mine")
        frames = _received(router)  # it reaches the application: it does not collide with the owner's id
        assert frames is not None and frames[0].bytes == identity
        assert not bound.admit(frames[0].bytes, frames[1])
        thief.close(0)
    _wait_for(caplog, "refused an identity takeover: 'gw-1' is bound to key")
    owner.send(b"still mine")
    frames = _received(router)
    assert frames is not None and frames[0].bytes == owner_id and bound.admit(frames[0].bytes, frames[1])
    owner.close(0)
    ctx.term()


def test_generate_refuses_to_overwrite_a_key_pair(keys: Path) -> None:
    with pytest.raises(curve.CurveError, match="exists"):
        curve.generate(keys / "pairs", "server")
    assert (keys / "pairs" / "server.key_secret").stat().st_mode & 0o077 == 0


def test_tokenwire_keys_generate_writes_a_usable_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from clients.cli import main

    assert main(["keys", "generate", str(tmp_path), "gw"]) == 0
    pair = curve.load_keypair(tmp_path / "gw.key_secret")
    assert curve.load_public_key(tmp_path / "gw.key") == pair.public
    assert "gw.key_secret" in capsys.readouterr().out
    assert main(["keys", "generate", str(tmp_path), "gw"]) == 1  # never overwrites a secret


def test_curve_options_name_what_is_missing(keys: Path) -> None:
    import argparse

    from ops.curve_options import add_curve_options, curve_config

    parser = argparse.ArgumentParser()
    add_curve_options(parser, "gateway")
    assert curve_config(parser.parse_args([])) is None  # CURVE off by default
    secret = str(keys / "pairs" / "server.key_secret")
    with pytest.raises(SystemExit, match="--curve-allowed-keys-dir is required"):
        curve_config(parser.parse_args(["--curve-secret-key-file", secret]))
    with pytest.raises(SystemExit, match="--curve-worker-keys-dir is required"):
        curve_config(parser.parse_args(["--curve-secret-key-file", secret, "--curve-allow-any"]))
    settings = curve_config(parser.parse_args(["--curve-secret-key-file", secret, "--curve-allow-any",
                                               "--curve-worker-keys-dir", str(keys / "allowed")]))
    assert settings is not None and settings.allowed is None and len(settings.workers) == 2
