"""Tool calls in a chat's output: the formats models write them in, the guide that
forces a call, and the splitter that streams text and calls apart.

Parsers (`--tool-parser`, or read from the model's chat template):
- `hermes` (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
  after optional text;
- `llama3_json` (Llama 3.1-3.3): the output is `{"name": ..., "parameters": {...}}` (several joined by `;`),
  after an optional `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
The gateway's text leaves special tokens out, so a marker that is one (`<|python_tag|>`,
`[TOOL_CALLS]`) may be missing: the JSON that follows it is recognised without it.

A forced call (`tool_choice` "required" or a named function) is not left to the model's
format: the output is guided by a JSON schema built from the tools (the named function's
parameters, or a list of {name, parameters} objects, one of the tools each), so it always
parses and validates, whatever the model would have written.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

PARSERS = ("hermes", "llama3_json", "mistral")
Choice = Literal["none", "auto", "required"] | str  # a str other than those: the named function


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """As OpenAI's message.tool_calls entry (with `index`: a streamed delta's)."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def parser_for(chat_template: str | None, configured: str | None) -> str:
    """The parser a model's output is read with: the configured one, else the format its
    chat template teaches (hermes where it names none)."""
    if configured is not None:
        return configured
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True, slots=True)
class ToolUse:
    """How one chat request's output is read for calls."""

    parser: str
    choice: Choice

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; a forced call that does not parse (it ran
        out of tokens) is left as content."""
        if self.choice in ("none", "auto"):
            return parse(self.parser, text)
        try:
            return None, parse_forced(self.choice, text)
        except (ValueError, KeyError, TypeError):
            return text, []


# -- the model's own formats ------------------------------------------------------------------

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
# Where each format's calls begin; `anywhere`: after text, else only at the output's start.
_STARTS: dict[str, tuple[tuple[str, ...], bool]] = {
    "hermes": (("<tool_call>",), True),
    "llama3_json": (("<|python_tag|>", '{"name"'), False),
    "mistral": (("[TOOL_CALLS]", '[{"name"'), False),
}


def _loads(text: str) -> Any:
    # Not strict: a model (or a guide) may leave a control character raw in a string;
    # the arguments are written out again, valid, by json.dumps.
    return json.loads(text, strict=False)


class JsonEscaper:
    """JSON text, fragment by fragment, with control characters inside strings escaped
    (a guided output may hold them raw; a client's strict parser refuses them)."""

    def __init__(self) -> None:
        self.in_string = False
        self.escaped = False

    def __call__(self, fragment: str) -> str:
        out = []
        for ch in fragment:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                elif ch < " ":
                    ch = f"\\u{ord(ch):04x}"
            elif ch == '"':
                self.in_string = True
            out.append(ch)
        return "".join(out)


def _call(obj: Any) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call is an object with a name")
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output; text that does not parse as calls is content."""
    start = call_start(parser, text)
    if start is None:
        return text, []
    content, region = text[:start], text[start:]
    try:
        calls = _parse_region(parser, region)
    except ValueError:
        return text, []
    return (content.strip() or None), calls


def _parse_region(parser: str, region: str) -> list[ToolCall]:
    if parser == "hermes":
        calls = [_call(_loads(body)) for body in _HERMES_CALL.findall(region)]
    elif parser == "llama3_json":
        body = region.removeprefix("<|python_tag|>").strip()
        calls = [_call(_loads(part)) for part in _split_top_level(body, ";")]
    else:
        body = region.removeprefix("[TOOL_CALLS]").strip()
        items = _loads(body)
        calls = [_call(item) for item in (items if isinstance(items, list) else [items])]
    if not calls:
        raise ValueError("no tool call")
    return calls


def _split_top_level(text: str, sep: str) -> list[str]:
    """`text` split at `sep` where it stands outside JSON strings and brackets."""
    parts, depth, in_string, escaped, last = [], 0, False, False, 0
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[last:i])
            last = i + 1
    parts.append(text[last:])
    return [p.strip() for p in parts if p.strip()]


def call_start(parser: str, text: str) -> int | None:
    """Where the calls begin in `text`, if they do."""
    markers, anywhere = _STARTS[parser]
    if anywhere:
        found = [i for i in (text.find(m) for m in markers) if i >= 0]
        return min(found) if found else None
    stripped = text.lstrip()
    return len(text) - len(stripped) if stripped.startswith(markers) else None


def _may_start(parser: str, text: str) -> int | None:
    """Where `text` may still turn out to begin a call as more arrives (a marker's start
    at its end, or for the start-only formats, the whole of it): held back from content."""
    markers, anywhere = _STARTS[parser]
    if not anywhere:
        stripped = text.lstrip()
        return 0 if any(m.startswith(stripped) for m in markers) else None
    for at in range(max(0, len(text) - max(map(len, markers)) + 1), len(text)):
        if any(m.startswith(text[at:]) for m in markers):
            return at
    return None


# -- forcing a call ------------------------------------------------------------------------------

def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}


def forced_schema(tools: list[dict[str, Any]], choice: Choice, parallel: bool) -> dict[str, Any] | None:
    """The JSON schema a forced call's output is guided by; None when nothing is forced."""
    functions = _functions(tools)
    if choice in ("none", "auto"):
        return None
    if choice != "required":
        return functions[choice]
    one = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
            "required": ["name", "parameters"], "additionalProperties": False}
           for name, params in functions.items()]  # fmt: skip
    return {"type": "array", "items": {"anyOf": one}, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def parse_forced(choice: Choice, text: str) -> list[ToolCall]:
    """The calls of a guided output (forced_schema's shape)."""
    if choice == "required":
        return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in _loads(text)]
    return [ToolCall(choice, JsonEscaper()(text.strip()))]


# -- streaming ------------------------------------------------------------------------------------


class ToolStream:
    """A chat's streamed text as OpenAI's deltas: content while it cannot be part of a
    call, then tool_calls deltas (id and name, then the arguments), never a character
    of a call as content. A forced named call streams its arguments as they come; other
    calls are sent once the output ends, when they parse."""

    def __init__(self, parser: str, choice: Choice) -> None:
        self.parser = parser
        self.choice = choice
        self.forced = choice not in ("none", "auto")
        self.text = ""  # all of it
        self.sent = 0  # characters of `text` sent as content (or, forced named, as arguments)
        self.calls: list[ToolCall] = []
        self.named: ToolCall | None = None
        self.escape = JsonEscaper()

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """The deltas to send for this much more text."""
        self.text += delta
        if self.choice == "required":
            return []
        if self.forced:  # a named call: its arguments, as they come
            out = []
            if self.named is None:
                self.named = ToolCall(self.choice, "")
                out.append({"tool_calls": [{"index": 0, "id": self.named.id, "type": "function",
                                            "function": {"name": self.choice, "arguments": ""}}]})  # fmt: skip
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": self.escape(delta)}}]})
            self.sent = len(self.text)
            return out
        start = call_start(self.parser, self.text)
        held = start if start is not None else _may_start(self.parser, self.text)
        end = len(self.text) if held is None else held
        if end <= self.sent:
            return []
        content, self.sent = self.text[self.sent : end], end
        return [{"content": content}]

    def finish(self) -> list[dict[str, Any]]:
        """The deltas left once the output has ended."""
        if self.forced:
            if self.choice == "required":
                self.calls = parse_forced(self.choice, self.text)
                return _call_deltas(self.calls)
            out = self.feed("") if self.named is None else []
            assert self.named is not None
            self.calls = [ToolCall(self.named.name, JsonEscaper()(self.text.strip()), self.named.id)]
            return out
        _, calls = parse(self.parser, self.text)
        self.calls = calls
        if not calls:  # what was held back was not a call after all
            rest = self.text[self.sent :]
            return [{"content": rest}] if rest else []
        return _call_deltas(calls)


def _call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Each call as OpenAI streams one: its id and name, then its arguments."""
    out = []
    for i, call in enumerate(calls):
        out.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": ""}}]})  # fmt: skip
        out.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
    return out
