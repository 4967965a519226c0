"""The engine process's side of disaggregated serving: which requests hand their KV
blocks on when their first token is out, and the blocks imported from other workers.
Both run between engine steps (worker/executor/kv_export.py does the reading and
writing); what they give crosses the pipe to the worker, which does the sending.

A hand-off's blocks leave as host bytes (the frames transport) or, where the worker
chose CUDA IPC and the cache is on CUDA, in a device buffer shared with the decode worker
(worker/backends/torch_kv_ipc.py) and held here until the worker passes on its answer
(`returned`) or the loan runs out."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from protocol.status import FinishReason
from worker.executor.kv_export import (
    KvBlocks,
    KvLayout,
    KvLayoutError,
    layout_of,
    prefix_blocks,
    store_of,
    write_blocks,
)
from worker.executor.kv_shared import SHARED_FOR_S, SharedBuffers
from worker.executor.step_output import StepOutput
from worker.executor.types import Response
from worker.service.kv_transport import Transport

if TYPE_CHECKING:
    from worker.executor import EngineCore
    from worker.executor.kv_shared import IpcBuffer

Returned = Literal["copied", "refused", "unsent"]  # how a loan ended (EngineKv.returned)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KvExported:
    """A handed-off request's blocks, and how long reading them took (None where none can
    be exported: the backend keeps no cache to read). With `ipc`, the blocks' `data` is
    empty: they are in the device buffer shared under that handle."""

    exec_id: int
    kv: KvBlocks | None
    seconds: float = 0.0
    ipc: IpcBuffer | None = None


@dataclass(frozen=True, slots=True)
class KvImported:
    """The engine's answer to a transfer: the blocks written, or why none were."""

    transfer_id: str
    num_blocks: int
    num_bytes: int
    seconds: float
    error: str | None = None
    ipc: bool = False  # the blocks were shared by CUDA IPC: the sender waits for an answer
    opened: bool = True  # (by CUDA IPC) the handle opened here; if not, the sender sends frames


@dataclass(slots=True)
class _Watched:
    prompt: list[int]
    model: str
    transport: Transport
    tokens: list[int] = field(default_factory=list)


def cuda_devices(core: EngineCore) -> tuple[str, ...]:
    """The UUIDs of the GPUs this engine sees where its KV cache is on CUDA, by device
    index (so that a CUDA IPC handle of any of them can be opened); () where it is not."""
    try:
        on_cuda = store_of(core.backend).on_cuda()
    except KvLayoutError:
        return ()
    if not on_cuda:
        return ()
    from worker.backends import torch_kv_ipc  # only a CUDA cache gets here

    return torch_kv_ipc.device_uuids()


def host_id() -> str:
    """What CUDA IPC handles name their host by (a CPU engine needs no torch for it)."""
    from worker.backends.torch_kv_ipc import host_id

    return host_id()


def ends_for_hand_off(response: Response) -> bool:
    """Whether a hand-off's final response leaves the rest to the decode worker: it ended
    for its one-token bound, not for an end token, a stop word, an error or a cancel."""
    result = response.result
    return result is not None and result.is_final and result.finish_reasons[0] == FinishReason.LENGTH


class EngineKv:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._watched: dict[int, _Watched] = {}
        self._shared = SharedBuffers(SHARED_FOR_S)  # the KvBlocks of each shared buffer, by executor id

    def layout(self, model: str) -> KvLayout:
        core = self.core
        tp = core.config.parallel_config.tensor_parallel_size
        return layout_of(core.blocks, store_of(core.backend), model, tp)

    def watch(self, exec_id: int, prompt: list[int], model: str, transport: Transport = "frames") -> None:
        """Export this request's blocks when it ends after its first token."""
        self._watched[exec_id] = _Watched(prompt, model, transport)

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
            tokens = watched.prompt + watched.tokens + list(r.result.output_token_ids[0])
            done.append(self._export(r.request_id, watched, tokens))
        return done

    def _export(self, exec_id: int, watched: _Watched, tokens: list[int]) -> KvExported:
        began = time.perf_counter()
        try:
            store = store_of(self.core.backend)
            layout = self.layout(watched.model)
        except KvLayoutError as e:  # the decode worker computes the prompt instead
            log.warning("request %d: its KV blocks cannot be exported: %s", exec_id, e)
            return KvExported(exec_id, None)
        block_ids = prefix_blocks(self.core.blocks, tokens)
        covered = tuple(tokens[: len(block_ids) * layout.block_size])
        on_cuda = store.on_cuda()
        try:
            if watched.transport == "cuda_ipc" and block_ids and on_cuda:
                from worker.backends import torch_kv_ipc

                buffer = store.gather(block_ids)
                shared = torch_kv_ipc.share(buffer)
                self._shared.keep(exec_id, KvBlocks(layout, covered, buffer), lambda: torch_kv_ipc.give_up(shared))
                return KvExported(exec_id, KvBlocks(layout, covered, b""), time.perf_counter() - began, shared)
            data = store.read(block_ids) if block_ids else b""
        except _out_of_memory(on_cuda) as e:  # no room for the buffer: the decode worker computes the prompt
            log.warning("request %d: no memory to gather its KV blocks: %s", exec_id, e)
            return KvExported(exec_id, None)
        return KvExported(exec_id, KvBlocks(layout, covered, data), time.perf_counter() - began)

    def returned(self, exec_id: int, outcome: Returned) -> KvExported | None:
        """The end of a loan: the decode worker copied the buffer (it is freed), could not
        open it (its blocks come back as host bytes, to be sent as frames), or never got
        the handle (freed). None but for the second, or where the loan had run out."""
        if outcome == "copied":
            self._shared.copied(exec_id)
            return None
        returned: KvBlocks | None = self._shared.refused(exec_id)
        if outcome == "unsent" or returned is None:
            return None
        device_buffer: Any = returned.data
        return KvExported(exec_id, dataclasses.replace(returned, data=bytes(device_buffer.cpu().numpy().data)))

    def expire(self) -> None:
        """Free the buffers whose loan ran out unanswered."""
        for exec_id in self._shared.expire():
            log.warning("request %d: its shared KV buffer was not acknowledged; freed", exec_id)

    @property
    def shared(self) -> int:
        """Buffers shared and not yet returned."""
        return len(self._shared)

    def import_(self, transfer_id: str, model: str, kv: KvBlocks, ipc: IpcBuffer | None = None,
                age_s: float = 0.0) -> KvImported:  # fmt: skip
        """Write another worker's blocks into the prefix cache: bytes, or (`ipc`) a buffer
        it shared `age_s` seconds ago, copied device to device and let go of before this
        returns (so that the answer frees it)."""
        began = time.perf_counter()
        if ipc is not None:
            from worker.backends import torch_kv_ipc

            try:
                kv = dataclasses.replace(kv, data=torch_kv_ipc.open_buffer(ipc, age_s))
            except torch_kv_ipc.KvIpcError as e:
                return KvImported(transfer_id, 0, 0, 0.0, str(e), ipc=True, opened=False)
        try:
            written = write_blocks(self.core.blocks, store_of(self.core.backend), self.layout(model), kv)
        except KvLayoutError as e:
            return KvImported(transfer_id, 0, 0, 0.0, str(e), ipc=ipc is not None)
        finally:
            if ipc is not None:
                import torch

                torch.cuda.synchronize()  # the copies out of the buffer, on whichever GPU they ran
        return KvImported(transfer_id, written, kv.num_bytes, time.perf_counter() - began, ipc=ipc is not None)


def _out_of_memory(on_cuda: bool) -> tuple[type[BaseException], ...]:
    if not on_cuda:
        return (MemoryError,)
    import torch

    return (MemoryError, torch.OutOfMemoryError)
