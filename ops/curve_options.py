"""The --curve-* command-line options of workers, gateways and gateway clients, and
the settings they give (ops.curve, which needs zmq, loads only when CURVE is on:
`tokenwire --help` stays light)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ops.curve import ClientCurve, CurveConfig


def add_curve_options(p: argparse.ArgumentParser, role: str) -> None:
    """--curve-* options of a worker ("worker") or a gateway ("gateway"); add before add_config_options."""
    peers = "gateways" if role == "worker" else "clients"
    p.add_argument("--curve-secret-key-file", default=None, metavar="FILE",
                   help="this process's CURVE key pair (NAME.key_secret from `tokenwire keys generate`); "
                   "given: CURVE on (default off: keep the service on loopback)")
    p.add_argument("--curve-allowed-keys-dir", default=None, metavar="DIR",
                   help=f"public keys (*.key) of the {peers} accepted under CURVE")
    if role == "gateway":
        p.add_argument("--curve-allow-any", action="store_true",
                       help="accept any client that completes a CURVE handshake (encryption without an allow list)")
        p.add_argument("--curve-worker-keys-dir", default=None, metavar="DIR",
                       help="public keys (*.key) of the workers this gateway connects to; "
                       "a registry entry with another key is refused")


def add_client_curve_options(p: argparse.ArgumentParser) -> None:
    """--curve-* options of a gateway client (`tokenwire generate`, the jobs consumer)."""
    p.add_argument("--curve-secret-key-file", default=None, metavar="FILE",
                   help="this client's CURVE key pair (NAME.key_secret); given: connect with CURVE "
                   "(the gateways must list its public key, or allow any)")
    p.add_argument("--curve-server-key", default=None, metavar="FILE",
                   help="the gateways' CURVE public key (NAME.key), required with --curve-secret-key-file")


def client_curve(args: argparse.Namespace) -> ClientCurve | None:
    """The ClientCurve the client --curve-* options give; SystemExit naming the problem."""
    if args.curve_secret_key_file is None:
        return None
    from ops.curve import ClientCurve, CurveError

    try:
        if args.curve_server_key is None:
            raise CurveError("--curve-server-key is required with --curve-secret-key-file")
        return ClientCurve.from_files(Path(args.curve_secret_key_file), Path(args.curve_server_key))
    except CurveError as e:
        raise SystemExit(f"tokenwire: bad CURVE configuration: {e}") from None


def curve_config(args: argparse.Namespace) -> CurveConfig | None:
    """The CurveConfig the --curve-* options give; SystemExit naming the problem."""
    if args.curve_secret_key_file is None:
        return None
    from ops.curve import CurveConfig, CurveError, load_keypair, load_public_keys

    role = "gateway" if hasattr(args, "curve_worker_keys_dir") else "worker"
    try:
        keypair = load_keypair(Path(args.curve_secret_key_file))
        allow_any = getattr(args, "curve_allow_any", False)
        if args.curve_allowed_keys_dir is None and not allow_any:
            raise CurveError("--curve-allowed-keys-dir is required with --curve-secret-key-file"
                             + (" (or --curve-allow-any)" if role == "gateway" else ""))
        allowed = None if allow_any else load_public_keys(Path(args.curve_allowed_keys_dir))
        workers: frozenset[bytes] = frozenset()
        if role == "gateway":
            if args.curve_worker_keys_dir is None:
                raise CurveError("--curve-worker-keys-dir is required with --curve-secret-key-file")
            workers = load_public_keys(Path(args.curve_worker_keys_dir))
    except CurveError as e:
        raise SystemExit(f"tokenwire {role}: bad CURVE configuration: {e}") from None
    return CurveConfig(keypair, allowed, workers)
