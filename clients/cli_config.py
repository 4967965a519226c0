"""`tokenwire config check FILE`: validate a config file before a service reads it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from clients.cli import Subparsers


def register(subparsers: Subparsers) -> None:
    config = subparsers.add_parser("config", help="configuration files")
    commands = config.add_subparsers(title="commands", metavar="COMMAND", required=True)
    check = commands.add_parser(
        "check", help="validate a TOML config file: every table, every key, every value"
    )
    check.add_argument("file", type=Path)
    check.set_defaults(handler=check_config)


def _config_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parsers, anywhere under the tokenwire command, that read a config section."""
    found: dict[str, argparse.ArgumentParser] = {}
    section = parser.get_default("_config_section")
    if section:
        found[section] = parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.update(_config_parsers(sub))
    return found


def check_config(args: argparse.Namespace) -> int:
    from clients.cli import build_parser
    from ops.config import ConfigError, check_file

    try:
        settings = check_file(args.file, _config_parsers(build_parser()))
    except ConfigError as e:
        print(f"{args.file}: invalid\n{e}", file=sys.stderr)
        return 1
    tables = ", ".join(f"[{name}]" for name in settings) or "no tables"
    print(f"{args.file}: ok ({tables})")
    return 0
