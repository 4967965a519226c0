"""Reasoning in a chat's output: the text a thinking model writes between `<think>`
and `</think>`, answered as `reasoning_content` apart from `content`.

Parsers (`--reasoning-parser`, or `think` where the model's chat template uses the tags):
- `think` (Qwen3 and the like): reasoning only where the output opens with `<think>`
  (a template may turn thinking off, `enable_thinking`, and then it is all content);
- `deepseek_r1`: the output starts in reasoning (the template opened the tag in the
  prompt) and `</think>` ends it.
"""

from __future__ import annotations

PARSERS = ("think", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"


def parser_for(chat_template: str | None, configured: str | None) -> str | None:
    """The configured parser, else `think` for a template that uses the tags, else none."""
    if configured is not None:
        return configured
    return "think" if chat_template and CLOSE in chat_template else None


def split(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a whole output."""
    stripped = text.lstrip()
    opened = stripped.startswith(OPEN)
    if not opened and parser != "deepseek_r1":
        return None, text
    body = stripped.removeprefix(OPEN)
    reasoning, closed, content = body.partition(CLOSE)
    if not closed:
        return reasoning, ""  # it ran out while thinking
    return reasoning, content.lstrip("\n")


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` may begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """A streamed output split as it comes: ("reasoning_content" | "content", text) pieces,
    holding back what may be the start of a tag."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.state = "start"  # start (not yet known), reasoning, content
        self.buffer = ""
        self.after_close = False  # the newlines after </think> are not content (as in split)

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self.buffer += delta
        out: list[tuple[str, str]] = []
        if self.state == "start":
            stripped = self.buffer.lstrip()
            if stripped.startswith(OPEN):
                self.state, self.buffer = "reasoning", stripped.removeprefix(OPEN)
            elif OPEN.startswith(stripped):
                return out  # may still open
            else:
                self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self.state == "reasoning":
            before, closed, after = self.buffer.partition(CLOSE)
            if closed:
                if before:
                    out.append(("reasoning_content", before))
                self.state, self.buffer, self.after_close = "content", after, True
            else:
                keep = _held(self.buffer, CLOSE)
                ready, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
                return [("reasoning_content", ready)] if ready else []
        if self.after_close:
            self.buffer = self.buffer.lstrip("\n")
            self.after_close = not self.buffer
        if self.state == "content" and self.buffer:
            out.append(("content", self.buffer))
            self.buffer = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What is held back once the output ends."""
        rest, self.buffer = self.buffer, ""
        if not rest:
            return []
        if self.state == "start":
            return [("reasoning_content" if self.parser == "deepseek_r1" else "content", rest)]
        return [("reasoning_content" if self.state == "reasoning" else "content", rest)]
