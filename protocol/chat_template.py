"""Chat messages rendered into a prompt with a model's own chat template.

One Jinja environment for the whole service: the gateway renders the `messages`
of a submit (protocol/request.py) with the template its workers sent in
`Ready`, and the in-process `LLM.apply_chat_template` renders with the one its
checkpoint holds, so both give the model the same text.

The environment is what Hugging Face transformers gives templates (a template
written for `apply_chat_template` renders the same here): sandboxed and
immutable (a template is data from a checkpoint, not trusted code), blocks
trimmed, loop controls, a `tojson` that keeps non-ASCII text, the globals
`raise_exception` and `strftime_now`, the `{% generation %}` tag (a no-op: it
marks assistant text for training masks), and the special tokens by name.

Imports only jinja2 beyond the standard library; `protocol/__init__.py` does
not import it, so the client library does not load Jinja.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateError", "render_chat"]


class ChatTemplateError(ValueError):
    """The template is missing, does not parse, or refused the messages (raise_exception)."""


class _Generation(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's Extension declares it so)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:  # fmt: skip
    # As transformers': jinja2's own tojson escapes HTML characters, which a prompt must not.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(
    template: str | None,
    messages: Iterable[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text for `messages` (dicts with `role` and `content`); raises
    ChatTemplateError naming what went wrong. `extra`: more variables the template
    may read (`tools`, `enable_thinking`, ...)."""
    if not template:
        raise ChatTemplateError("this model has no chat template: send a prompt instead of messages")
    try:
        return str(
            _compiled(template).render(
                **(extra or {}),
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=bos_token or "",
                eos_token=eos_token or "",
            )
        )
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {e}") from e
