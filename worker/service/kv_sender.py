"""The prefill side of KV transfers in the worker: each hand-off's blocks, or the handle
of the device buffer shared with them, sent to its decode worker; the decode workers'
answers to shared buffers passed on to the engine, which frees them, and the blocks of a
buffer that could not be opened sent again as frames. Runs on the result pump's
thread, which owns these sockets."""

from __future__ import annotations

import logging
import time

import protocol
from ops.metrics import WorkerMetrics
from worker.executor.kv_shared import SHARED_FOR_S
from worker.service.engine import EngineProcess
from worker.service.engine_kv import KvExported
from worker.service.kv_transfer import KvPushers, cuda_ipc_of, to_frames
from worker.service.kv_transport import KvTransport

log = logging.getLogger(__name__)


class KvSender:
    def __init__(self, pushers: KvPushers, engine: EngineProcess, transport: KvTransport,
                 metrics: WorkerMetrics) -> None:  # fmt: skip
        self.pushers = pushers
        self.engine = engine
        self.transport = transport
        self.metrics = metrics
        self._shared: dict[str, tuple[int, str, float]] = {}  # by transfer: executor id, decode endpoint, due
        self._resending: dict[int, tuple[str, str]] = {}  # by executor id: transfer, decode endpoint

    def send(self, handoff: protocol.KvHandoff, exported: KvExported, request: str) -> int:
        """Send a hand-off's blocks; how many went (0: none, or none could be queued)."""
        kv = exported.kv
        if kv is None or not kv.num_blocks:
            return 0
        shared = None if exported.ipc is None else cuda_ipc_of(exported.ipc)
        if self.pushers.send(handoff.kv_address, to_frames(handoff.transfer_id, kv, shared, self.pushers.limits)):
            self.metrics.kv_transferred("out", "ok" if shared is None else "shared", kv.num_bytes, exported.seconds)
            if shared is not None:
                due = time.monotonic() + SHARED_FOR_S
                self._shared[handoff.transfer_id] = (exported.exec_id, handoff.kv_address, due)
            return kv.num_blocks
        log.warning("request %s: the KV blocks for %s could not be queued; it is decoded without them", request,
                    handoff.kv_address)  # fmt: skip
        self.metrics.kv_transferred("out", "dropped")
        if shared is not None:
            self.engine.return_kv(exported.exec_id, "unsent")
        return 0

    def take_answers(self) -> None:
        """The decode workers' answers to shared buffers, passed to the engine; the loans past
        their time are forgotten here as the engine frees them."""
        if not self._shared:
            return
        for address, ack in self.pushers.acks():
            shared = self._shared.pop(ack.transfer_id, None)
            if shared is None or shared[1] != address:
                continue
            exec_id = shared[0]
            if ack.opened:
                self.metrics.kv_transferred("out", "acked")
                self.engine.return_kv(exec_id, "copied")
                continue
            log.warning("transfer %s: the decode worker at %s could not open the CUDA IPC handle; sending frames",
                        ack.transfer_id, address)  # fmt: skip
            self.metrics.kv_transferred("out", "unopened")
            self.transport.refused(address)
            self._resending[exec_id] = (ack.transfer_id, address)
            self.engine.return_kv(exec_id, "refused")
        now = time.monotonic()
        for transfer in [t for t, (_, _, due) in self._shared.items() if now >= due]:
            del self._shared[transfer]
            self.metrics.kv_transferred("out", "expired")

    def close(self) -> None:
        self.pushers.close()

    def resend(self, exported: KvExported) -> None:
        """The blocks of a shared buffer the decode worker could not open, as frames."""
        transfer, address = self._resending.pop(exported.exec_id, ("", ""))
        if exported.kv is None or not transfer:
            return
        sent = self.pushers.send(address, to_frames(transfer, exported.kv, limits=self.pushers.limits))
        self.metrics.kv_transferred("out", "ok" if sent else "dropped", exported.kv.num_bytes if sent else 0)
