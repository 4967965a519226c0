"""The requests in flight, and the one place a request ends.

A request enters with `add` (intake.py built its entry) and leaves through `end`
(it answered its last response), `fail` (an error ends it) or `fail_running`
(the step failed); every other part of the engine looks requests up here and
never removes one itself. The table also holds the output of the step in
progress, since ending a request is what most of that output is."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from worker.executor.beam_search import BeamSearch
from worker.executor.scheduler import Scheduler
from worker.executor.sequence import Sequence
from worker.executor.step_output import StepOutput
from worker.executor.types import FinishReason, Request, RequestState, Response


@dataclass(eq=False, slots=True)
class Entry:
    """A request in flight: its sequences (one per returned sequence in sampling;
    the live beams in beam search)."""

    request_id: int
    request: Request
    seqs: list[Sequence]
    beam: BeamSearch | None = None
    done: int = 0  # sequences that sent their last response


class RequestTable:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.out = StepOutput()  # what the step in progress produced so far
        self._entries: dict[int, Entry] = {}

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def get(self, request_id: int) -> Entry | None:
        return self._entries.get(request_id)

    def add(self, entry: Entry) -> None:
        """Start a request: its leader queues; the other sequences fork it once it has
        computed the prompt (siblings.py), beams in the beam step."""
        self._entries[entry.request_id] = entry
        self.scheduler.add(entry.seqs[0])

    def reject(self, request_id: int, request: Request, message: str) -> None:
        """Answer a request that never started with an error."""
        self.out.responses.append(Response(request_id, error_msg=message, client_id=request.client_id))

    def end(self, request_id: int) -> None:
        """The request sent its final response (its sequences are freed already)."""
        del self._entries[request_id]

    def fail(self, request_id: int, message: str) -> None:
        """End one request with an error (its sequences are freed)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        for seq in entry.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.finish(FinishReason.CANCELLED)
        self.out.responses.append(Response(request_id, error_msg=message, client_id=entry.request.client_id))

    def fail_running(self, message: str) -> None:
        """End every request that had a sequence in a step (a step failed)."""
        for request_id, entry in list(self._entries.items()):
            if any(s.num_pending or s.state in (RequestState.CONTEXT, RequestState.GENERATION) for s in entry.seqs):
                self.fail(request_id, message)

    def take_output(self) -> StepOutput:
        out, self.out = self.out, StepOutput()
        return out
