"""The `tokenwire` command line.

Each subcommand lives in its own module with a `register(subparsers)` function
that adds its parser and sets `handler` (a function from the parsed arguments to
an exit code). Adding one is that function plus one line in COMMANDS. Keep heavy
imports (torch, zmq, the executor) inside the handler so `tokenwire --help`
stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

Handler = Callable[[argparse.Namespace], int]
# argparse does not export the type of add_subparsers' result.
Subparsers = Any

# Modules that define `register(subparsers)`, in the order --help lists them.
# More come with later issues (e.g. `model fetch`, jobs).
COMMANDS: tuple[str, ...] = (
    "clients.cli_up",
    "clients.cli_processes",
    "clients.cli_requests",
    "clients.cli_jobs",
    "clients.cli_lora",
    "clients.cli_config",
    "clients.cli_keys",
)


def _version() -> str:
    try:
        return version("tokenwire")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser(commands: Sequence[str] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenwire",
        description="Message-queue driven LLM inference: gateways, GPU workers, Redis.",
    )
    parser.add_argument("--version", action="version", version=f"tokenwire {_version()}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module in commands:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None, commands: Sequence[str] = COMMANDS) -> int:
    parser = build_parser(commands)
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
