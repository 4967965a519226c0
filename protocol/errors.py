"""The one exception the protocol raises for bad input."""

from __future__ import annotations


class ProtocolError(ValueError):
    """A message that cannot be accepted: malformed, over a limit, of an unknown
    version or kind, or failing validation. The text says which rule it broke.

    `kind` and `request_id` are filled in when the message got far enough to tell,
    so a receiver can answer the one request instead of dropping the message.
    """

    def __init__(self, message: str, *, kind: str | None = None, request_id: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.request_id = request_id
