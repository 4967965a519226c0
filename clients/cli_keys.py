"""`tokenwire keys generate DIR NAME`: a CURVE key pair for a worker, gateway or client."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from clients.cli import Subparsers


def register(subparsers: Subparsers) -> None:
    keys = subparsers.add_parser("keys", help="CURVE keys (ops/README.md: making and distributing keys)")
    commands = keys.add_subparsers(title="commands", metavar="COMMAND", required=True)
    generate = commands.add_parser(
        "generate", help="write DIR/NAME.key (public: give it to the peers) and DIR/NAME.key_secret (keep it here)"
    )
    generate.add_argument("dir", type=Path)
    generate.add_argument("name")
    generate.set_defaults(handler=generate_keys)


def generate_keys(args: argparse.Namespace) -> int:
    from ops.curve import CurveError, generate

    try:
        public, secret = generate(args.dir, args.name)
    except CurveError as e:
        print(f"tokenwire keys generate: {e}", file=sys.stderr)
        return 1
    print(f"public key: {public}\nsecret key: {secret} (mode 600; never copy it off this host)")
    return 0
