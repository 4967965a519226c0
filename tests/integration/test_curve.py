"""CURVE on, with a real worker and gateway: authenticated requests flow while an
unauthenticated client, a client with an unknown key, a gateway with the wrong
key, a fake worker written into Redis and an identity takeover are each refused
and logged. One stack for all of it (the processes are the slow part)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import zmq

import protocol
from clients.client import Client
from clients.connection import GatewayUnavailableError
from ops import curve
from tests.procs import CLIENT_OPTIONS, HEARTBEAT_S, Stack


def _keys(root: Path) -> Path:
    for name in ("worker", "gateway", "other-gateway", "client", "stranger"):
        curve.generate(root / "pairs", name)
    allow_lists = {"gateways": ("gateway", "other-gateway"), "clients": ("client",), "workers": ("worker",)}
    for folder, names in allow_lists.items():
        (root / folder).mkdir()
        for name in names:
            (root / folder / f"{name}.key").write_bytes((root / "pairs" / f"{name}.key").read_bytes())
    return root


def _client(root: Path, endpoint: str, name: str | None) -> Client:
    pair = None
    if name is not None:
        pair = curve.ClientCurve.from_files(root / "pairs" / f"{name}.key_secret", root / "pairs" / "gateway.key")
    return Client([endpoint], **CLIENT_OPTIONS, connect_timeout_s=1.0, connect_attempts=1,
                  curve=pair)


def _dealer(ctx: zmq.Context, root: Path, name: str, server: str, endpoint: str, identity: bytes) -> zmq.Socket:
    """A gateway-like DEALER to the worker, as someone holding `name`'s key pair."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    pair = curve.load_keypair(root / "pairs" / f"{name}.key_secret")
    curve.connect_as_client(sock, pair, curve.load_public_key(root / "pairs" / f"{server}.key"))
    sock.connect(endpoint)
    sock.send(protocol.encode(protocol.Hello(sender_id=identity.decode(), role="gateway", heartbeat_interval_s=1.0)))
    return sock


def test_curve_refuses_each_intruder_while_authenticated_traffic_flows(
    service_model: Path, redis_url: str, tmp_path: Path
) -> None:
    root = _keys(tmp_path / "keys")
    s = Stack(service_model, redis_url, tmp_path)
    ctx = zmq.Context()
    try:
        worker = s.worker("--curve-secret-key-file", str(root / "pairs" / "worker.key_secret"),
                          "--curve-allowed-keys-dir", str(root / "gateways"))
        gateway = s.gateway("--curve-secret-key-file", str(root / "pairs" / "gateway.key_secret"),
                            "--curve-allowed-keys-dir", str(root / "clients"),
                            "--curve-worker-keys-dir", str(root / "workers"))
        gateway.wait_workers(1)

        with _client(root, gateway.endpoint, "client") as client:
            assert len(client.generate([5, 6, 7], max_tokens=4).token_ids) == 4

            for name, logged in ((None, "gateway: refused a peer"), ("stranger", "unknown public key")):
                with _client(root, gateway.endpoint, name) as intruder, pytest.raises(GatewayUnavailableError):
                    intruder.generate([5, 6, 7], max_tokens=4)
                gateway.wait_log(logged, timeout=30)

            # A gateway with a key the worker does not know.
            wrong = _dealer(ctx, root, "stranger", "worker", worker.endpoint, b"gw-stranger")
            worker.wait_log("worker: refused a CURVE peer with an unknown public key", timeout=30)

            # An allowed gateway key taking the live gateway's name (its id, as Redis shows it): the
            # gateway's socket has a secret routing id, so the thief's messages reach the worker,
            # which refuses them and says why.
            thief = _dealer(ctx, root, "other-gateway", "worker", worker.endpoint, gateway.gateway_id.encode())
            worker.wait_log(f"worker: refused an identity takeover: '{gateway.gateway_id}'", timeout=30)
            assert f"gateway {gateway.gateway_id.encode()!r} lost its id" not in worker.log()
            # ... and under the id of a gateway whose connection ended: refused and logged.
            gone = _dealer(ctx, root, "gateway", "worker", worker.endpoint, b"gw-gone")
            worker.wait_log("gateway b'gw-gone' connected", timeout=30)
            gone.close(0)
            # libzmq ignores a connection under an identity its ROUTER still holds: until the
            # worker's side has seen the closed one go, a thief's connection goes nowhere, so it
            # tries again (a slow host takes longer to see it).
            deadline = time.monotonic() + 30
            while True:
                late_thief = _dealer(ctx, root, "other-gateway", "worker", worker.endpoint, b"gw-gone")
                try:
                    worker.wait_log("worker: refused an identity takeover: 'gw-gone'", timeout=2)
                    break
                except AssertionError:
                    late_thief.close(0)
                    if time.monotonic() > deadline:
                        raise
            assert len(client.generate([5, 6, 7], max_tokens=4).token_ids) == 4
            time.sleep(3 * HEARTBEAT_S)  # the worker's heartbeats to gateways would have reached them
            assert not wrong.poll(0) and not thief.poll(0) and not late_thief.poll(0)  # no answer to any

            # A fake worker in the registry, with a key the gateway does not pin.
            stranger = curve.load_public_key(root / "pairs" / "stranger.key").decode()
            fake = protocol.WorkerInfo(worker_id="fake", address="tcp://127.0.0.1:1", models=["tiny-llama"],
                                       host=socket.gethostname(), pid=os.getpid(), started_at=time.time(),
                                       curve_public_key=stranger)
            s.redis.set(s.keys.worker("fake"), protocol.encode(fake))
            s.redis.zadd(s.keys.workers(), {"fake": time.time()})
            refused = f"refused worker fake at tcp://127.0.0.1:1: its registry entry carries CURVE key {stranger}"
            gateway.wait_log(refused, timeout=30)

            for _ in range(5):  # still served, by the real worker only
                result = client.generate([5, 6, 7], max_tokens=4)
                assert len(result.token_ids) == 4
                assert s.request_stats(result.request_id)["worker"] == worker.worker_id
        assert "connecting to worker fake" not in gateway.log()
    finally:
        ctx.destroy(0)
        s.close()
