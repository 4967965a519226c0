"""What one client gets from one worker batch, built as the wire wants it."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import protocol
from protocol.packed import WIRE_CONTEXT, pack_ints


class ClientBatch:
    """One client's share of a worker batch: its plain streamed steps in columns
    with their text (protocol.StreamedTokens), every other response whole.

    Encoded from the payload directly, as `protocol.encode` would make it: a
    streamed token costs no model on the way through (the client validates what
    it receives). A request's columns precede its whole responses, as they did."""

    __slots__ = ("counts", "request_ids", "responses", "text", "token_ids")

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.counts: list[int] = []
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.responses: list[dict[str, Any]] = []

    def add_step(self, request_id: str, tokens: list[int], text: str) -> None:
        self.request_ids.append(request_id)
        self.counts.append(len(tokens))
        self.token_ids += tokens
        self.text.append(text)

    def add_response(self, response: protocol.Response) -> None:
        self.responses.append(response.model_dump(context=WIRE_CONTEXT, exclude_defaults=True))

    def messages(self, limits: protocol.Limits) -> Iterator[bytes]:
        """The encoded ResultBatch, or several where one would hold more entries
        than the client's max_array_len allows (columns first)."""
        n, step = len(self.request_ids), limits.max_array_len
        if n <= step and len(self.responses) <= step:
            yield self._encode(0, n, self.token_ids, self.responses, limits)
            return
        ends = list(itertools.accumulate(self.counts))
        for a in range(0, n, step):
            b = min(n, a + step)
            yield self._encode(a, b, self.token_ids[ends[a - 1] if a else 0 : ends[b - 1]], [], limits)
        for a in range(0, len(self.responses), step):
            yield self._encode(0, 0, [], self.responses[a : a + step], limits)

    def _encode(
        self, a: int, b: int, token_ids: list[int], responses: list[dict[str, Any]], limits: protocol.Limits
    ) -> bytes:
        # Field order and the defaults left out follow protocol.ResultBatch and StreamedTokens.
        payload: dict[str, Any] = {}
        if responses:
            payload["responses"] = responses
        if b > a:
            payload["streamed"] = {
                "request_ids": self.request_ids[a:b],
                "counts": pack_ints(self.counts[a:b]),
                "token_ids": pack_ints(token_ids),
                "text": self.text[a:b],
            }
        return protocol.encode_payload(protocol.ResultBatch.kind, payload, limits)
