"""Configuration: every command-line option of a service process is also settable
from an environment variable and from a TOML file, and pydantic validates what
those give, naming the bad key and where it came from.

The options are the process's own argparse parser (one definition, no second
list to keep in step): `add_config_options(parser, section)` goes last in its
`add_arguments`, and `apply_config(args)` first in its `run`. An option's range
is a pydantic field constraint carried by its argparse type (`Bounded`, e.g.
POSITIVE_INT), checked for every source, the command line included. Precedence:
command line > TOKENWIRE_<SECTION>_<OPTION> > the file's [<section>] table >
the parser's default. The file is --config FILE or $TOKENWIRE_CONFIG; one file
holds a table per process kind ([worker], [gateway], [jobs_consumer]).
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

CONFIG_ENV = "TOKENWIRE_CONFIG"
SECTIONS = ("worker", "gateway", "jobs_consumer")
_GIVEN = "_config_given"  # on the namespace: the options given on the command line
_SKIP = {"help", "version", "config"}


class ConfigError(ValueError):
    """Bad configuration; the text names each bad key and its source."""


class Bounded:
    """An argparse `type` with pydantic field constraints: argparse only converts
    the text; the settings model checks the range, whichever source gave the value."""

    def __init__(self, base: type, **constraints: Any) -> None:
        self.base = base
        self.annotation: Any = Annotated[base, Field(**constraints)]
        self.__name__ = base.__name__  # argparse names the type in its conversion errors

    def __call__(self, text: str) -> Any:
        return self.base(text)


POSITIVE_INT = Bounded(int, ge=1)
NON_NEGATIVE_INT = Bounded(int, ge=0)
POSITIVE_FLOAT = Bounded(float, gt=0.0)
NON_NEGATIVE_FLOAT = Bounded(float, ge=0.0)
PORT = Bounded(int, ge=0, le=65535)  # 0: off


def env_name(section: str, key: str) -> str:
    return f"TOKENWIRE_{section}_{key}".upper()


def add_config_options(parser: argparse.ArgumentParser, section: str) -> None:
    if section not in SECTIONS:
        raise ValueError(f"unknown config section {section!r}; one of {SECTIONS}")
    for action in parser._actions:
        if action.option_strings and action.dest not in _SKIP:
            _track(action)
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help=f"TOML file whose [{section}] table sets any option (default ${CONFIG_ENV}); "
        f"each option is also read from {env_name(section, '<OPTION>')}",
    )
    parser.set_defaults(_config_section=section, _config_model=settings_model(parser, section))


def apply_config(args: argparse.Namespace) -> None:
    """Fill in `args` from the environment and the config file, where the command
    line left an option at its default. Exits with the errors on bad values."""
    section: str = args._config_section
    model: type[BaseModel] = args._config_model
    given: set[str] = getattr(args, _GIVEN, set())
    path = args.config or os.environ.get(CONFIG_ENV)
    try:
        values, sources = _gather(model, section, Path(path) if path else None, os.environ)
        for key in given & set(model.model_fields):  # the command line's values: their ranges too
            values[key] = getattr(args, key)
            sources[key] = "--" + key.replace("_", "-")
        settings = _validate(model, values, sources)
    except ConfigError as e:
        sep = "\n" if "\n" in str(e) else " "  # one problem: one line
        raise SystemExit(f"tokenwire {section.replace('_', ' ')}: bad configuration:{sep}{e}") from None
    for key in values:
        if key not in given:
            setattr(args, key, getattr(settings, key))


def check_file(path: Path, parsers: Mapping[str, argparse.ArgumentParser]) -> dict[str, BaseModel]:
    """Validate every table of a config file against the parsers of the process
    kinds; the settings per table, or ConfigError listing every problem."""
    tables = _read_toml(path)
    problems = [f"{path}: [{name}]: unknown table; tables are {', '.join(SECTIONS)}" for name in tables
                if name not in parsers]
    out: dict[str, BaseModel] = {}
    for name, parser in parsers.items():
        if name not in tables:
            continue
        model = settings_model(parser, name)
        try:
            values, sources = _gather(model, name, path, {})
            out[name] = _validate(model, values, sources)
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("\n".join(problems))
    return out


def settings_model(parser: argparse.ArgumentParser, section: str) -> type[BaseModel]:
    """A pydantic model with one field per option of `parser`, typed from the option."""
    fields: dict[str, Any] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in _SKIP or action.dest.startswith("_"):
            continue
        fields[action.dest] = (_field_type(action), action.default)
    return create_model(
        f"{section}_settings", __config__=ConfigDict(extra="forbid"), **fields
    )


def _field_type(action: argparse.Action) -> Any:
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return bool
    base: Any = action.type.annotation if isinstance(action.type, Bounded) else action.type
    base = base if isinstance(action.type, Bounded | type) else str
    if action.choices is not None:
        base = Literal[tuple(action.choices)]
    if isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+"):
        return list[base]
    return base | None if action.default is None else base


def _track(action: argparse.Action) -> None:
    """Make the action record, on the namespace, that the command line gave it."""
    cls = type(action)

    def call(self: argparse.Action, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        cls.__call__(self, parser, namespace, values, option_string)
        given = getattr(namespace, _GIVEN, None)
        if given is None:
            given = set()
            setattr(namespace, _GIVEN, given)
        given.add(self.dest)

    action.__class__ = type(f"Tracked{cls.__name__}", (cls,), {"__call__": call})


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def _gather(
    model: type[BaseModel], section: str, path: Path | None, environ: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The values the file and the environment give, and where each came from."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path is not None:
        table = _read_toml(path).get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [{section}] must be a table")
        for key, value in table.items():
            name = key.replace("-", "_")
            values[name] = value
            sources[name] = f"{path}: [{section}] {key}"
    for key in model.model_fields:
        var = env_name(section, key)
        if var in environ:
            raw = environ[var]
            is_list = getattr(model.model_fields[key].annotation, "__origin__", None) is list
            values[key] = [v for v in raw.split(",") if v] if is_list else raw
            sources[key] = f"${var}"
    return values, sources


def _validate(model: type[BaseModel], values: dict[str, Any], sources: dict[str, str]) -> BaseModel:
    try:
        return model.model_validate(values)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            key = str(err["loc"][0]) if err["loc"] else ""
            where = sources.get(key, key)
            if err["type"] == "extra_forbidden":
                known = ", ".join(sorted(model.model_fields))
                lines.append(f"{where}: unknown key {key!r}; known keys: {known}")
            else:
                lines.append(f"{where}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError("\n".join(lines)) from None
