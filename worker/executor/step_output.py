"""What one engine step hands its driver: the step's responses and stats.

Plain streamed tokens come in columns because they are most of what a step
produces and the wire carries them the same way (`protocol.StreamedTokens`):
no Response object per token on the hot path."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.executor.types import FinishReason, IterationStats, RequestStats, Response, Result


@dataclass(slots=True)
class StepOutput:
    """What the core produced since the last `step()`.

    Plain streamed steps (not final, sequence 0, tokens alone, no client id) come in
    columns: request `ids[i]` produced `counts[i]` tokens, in order in `token_ids`;
    these map one to one onto the wire's `protocol.StreamedTokens`. Every other
    response comes whole in `responses` (errors, finals, beams, log probs, logits),
    after its request's columns. `request_stats` holds the stats of the requests
    that ended; `iteration_stats` one record per completed step."""

    ids: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    responses: list[Response] = field(default_factory=list)
    request_stats: list[RequestStats] = field(default_factory=list)
    iteration_stats: list[IterationStats] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.ids or self.responses or self.request_stats or self.iteration_stats)

    def stream(self, request_id: int, tokens: list[int]) -> None:
        self.ids.append(request_id)
        self.counts.append(len(tokens))
        self.token_ids += tokens

    def all_responses(self) -> list[Response]:
        """Every response, the columns expanded into Responses first (the order they happened in)."""
        out = []
        start = 0
        for request_id, n in zip(self.ids, self.counts, strict=True):
            tokens = self.token_ids[start : start + n]
            start += n
            out.append(Response(request_id, Result(False, [tokens], [FinishReason.NOT_FINISHED])))
        return out + self.responses
