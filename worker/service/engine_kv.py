"""The engine process's side of disaggregated serving: which requests hand their KV
blocks on when their first token is out, and the blocks imported from other workers.
Both run between engine steps (worker/executor/kv_export.py does the reading and
writing); what they give crosses the pipe to the worker, which does the sending."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protocol.status import FinishReason
from worker.executor.kv_export import KvBlocks, KvLayout, KvLayoutError, layout_of, read_blocks, store_of, write_blocks
from worker.executor.step_output import StepOutput
from worker.executor.types import Response

if TYPE_CHECKING:
    from worker.executor import EngineCore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KvExported:
    """A handed-off request's blocks, and how long reading them took (None where none can
    be exported: the backend keeps no cache to read)."""

    exec_id: int
    kv: KvBlocks | None
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class KvImported:
    """The engine's answer to a transfer: the blocks written, or why none were."""

    transfer_id: str
    num_blocks: int
    num_bytes: int
    seconds: float
    error: str | None = None


@dataclass(slots=True)
class _Watched:
    prompt: list[int]
    model: str
    tokens: list[int] = field(default_factory=list)


def ends_for_hand_off(response: Response) -> bool:
    """Whether a hand-off's final response leaves the rest to the decode worker: it ended
    for its one-token bound, not for an end token, a stop word, an error or a cancel."""
    result = response.result
    return result is not None and result.is_final and result.finish_reasons[0] == FinishReason.LENGTH


class EngineKv:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._watched: dict[int, _Watched] = {}

    def layout(self, model: str) -> KvLayout:
        core = self.core
        tp = core.config.parallel_config.tensor_parallel_size
        return layout_of(core.blocks, store_of(core.backend), model, tp)

    def watch(self, exec_id: int, prompt: list[int], model: str) -> None:
        """Export this request's blocks when it ends after its first token."""
        self._watched[exec_id] = _Watched(prompt, model)

    def exports(self, out: StepOutput) -> list[KvExported]:
        """The blocks of the watched requests that ended in this step's output. Called
        right after the step: what ended was freed into the prefix cache and nothing
        has been allocated since, so every full block of its prompt is still there."""
        if not self._watched:
            return []
        start = 0
        for exec_id, n in zip(out.ids, out.counts, strict=True):
            watched = self._watched.get(exec_id)
            if watched is not None:
                watched.tokens += out.token_ids[start : start + n]
            start += n
        done = []
        for r in out.responses:
            watched = self._watched.get(r.request_id)
            if watched is None or (r.result is not None and not r.result.is_final):
                continue
            del self._watched[r.request_id]
            if r.result is None or not ends_for_hand_off(r):
                continue
            began = time.perf_counter()
            tokens = watched.prompt + watched.tokens + list(r.result.output_token_ids[0])
            try:
                kv = read_blocks(self.core.blocks, store_of(self.core.backend), self.layout(watched.model), tokens)
            except KvLayoutError as e:  # the decode worker computes the prompt instead
                log.warning("request %d: its KV blocks cannot be exported: %s", r.request_id, e)
                kv = None
            done.append(KvExported(r.request_id, kv, time.perf_counter() - began))
        return done

    def import_(self, transfer_id: str, model: str, kv: KvBlocks) -> KvImported:
        began = time.perf_counter()
        try:
            written = write_blocks(self.core.blocks, store_of(self.core.backend), self.layout(model), kv)
        except KvLayoutError as e:
            return KvImported(transfer_id, 0, 0, 0.0, str(e))
        return KvImported(transfer_id, written, kv.num_bytes, time.perf_counter() - began)
