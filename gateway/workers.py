"""The gateway's view of its workers: one DEALER each, liveness, load, routing."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import zmq

import protocol
from gateway.prefix_index import PrefixIndex


@dataclass(eq=False, slots=True)
class WorkerLink:
    info: protocol.WorkerInfo
    socket: zmq.Socket
    connected_at: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    ready: bool = False
    draining: bool = False  # it said Drain: its requests finish here, new ones go elsewhere
    heartbeat_interval_s: float = 1.0
    models: list[str] = field(default_factory=list)
    lora_adapters: frozenset[str] = frozenset()  # as its Ready and LoraAdapters messages said
    lora_loadable: frozenset[str] = frozenset()  # not held, but loaded when a request names one (its --lora-dir)
    vocab_size: int | None = None
    max_seq_len: int | None = None
    load: protocol.WorkerLoad | None = None
    # Requests this gateway sent since the worker last reported its load: the
    # report cannot count them yet.
    sent_since_load: int = 0
    sent_blocks_since_load: int = 0  # their prompt blocks
    requests: set[str] = field(default_factory=set)
    kv: PrefixIndex = field(default_factory=PrefixIndex)  # what its KV cache holds
    submit_batches: bool = False  # its Ready said it takes SubmitBatch messages
    pending: list[bytes] = field(default_factory=list)  # encoded submits of this loop turn, not sent yet
    limits: protocol.Limits = protocol.DEFAULT_LIMITS  # the gateway's: what one message to the worker may hold

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def update_load(self, load: protocol.WorkerLoad | None) -> None:
        if load is not None:
            self.load = load
            self.sent_since_load = self.sent_blocks_since_load = 0

    def submit(self, data: bytes) -> None:
        """An encoded Submit: sent with the others of this turn of the gateway's loop
        (`flush`) where the worker takes batches, else at once."""
        if self.submit_batches:
            self.pending.append(data)
        else:
            self.socket.send(data)

    def send(self, data: bytes) -> None:
        """Any other message, after the submits queued before it (a cancel may be about one)."""
        self.flush()
        self.socket.send(data)

    def flush(self) -> None:
        """The queued submits, in as few messages as the limits allow."""
        if self.pending:
            pending, self.pending = self.pending, []
            for message in protocol.encode_submits(pending, self.limits):
                self.socket.send(message)

    def score(self) -> tuple[int, int]:
        """Lower is less loaded: requests waiting or running, then fewer free KV blocks."""
        load = self.load or protocol.WorkerLoad()
        busy = load.num_queued_requests + load.num_active_requests + self.sent_since_load
        return busy, -load.free_num_blocks


def serves(link: WorkerLink, model: str | None, lora: str | None) -> bool:
    """Whether the worker serves `model` (any when None) and holds the LoRA adapter `lora` (if any)."""
    return (model is None or model in link.models) and (lora is None or lora in link.lora_adapters)


def can_load(link: WorkerLink, model: str | None, lora: str) -> bool:
    """Whether the worker serves `model` (any when None) and can load the adapter `lora` on demand."""
    return (model is None or model in link.models) and lora in link.lora_loadable


def least_loaded(workers: list[WorkerLink], model: str | None, lora: str | None = None) -> WorkerLink | None:
    """The least-loaded ready worker serving `model` (any model when None) and holding the
    LoRA adapter `lora` (when given); if none holds it, the least-loaded one that can load
    it (a load costs a read from disk, so a busier holder still wins); ties at random."""
    candidates = eligible(workers, model, lora)
    if not candidates:
        return None
    best = min(w.score() for w in candidates)
    return random.choice([w for w in candidates if w.score() == best])


def eligible(workers: list[WorkerLink], model: str | None, lora: str | None) -> list[WorkerLink]:
    """The ready workers that serve `model` and hold `lora`; if none holds it, those that can load it."""
    available = [w for w in workers if w.ready and not w.draining]
    candidates = [w for w in available if serves(w, model, lora)]
    if not candidates and lora is not None:
        candidates = [w for w in available if can_load(w, model, lora)]
    return candidates


def adapter_models(workers: list[WorkerLink]) -> dict[str, str]:
    """LoRA adapter name -> the model of a ready worker that holds it, or else can load it
    (the first one's, should workers of different models have adapters of one name)."""
    found: dict[str, str] = {}
    live = [w for w in workers if w.ready and not w.draining and w.models]
    for w in live:
        for name in w.lora_adapters:
            found.setdefault(name, w.models[0])
    for w in live:
        for name in w.lora_loadable:
            found.setdefault(name, w.models[0])
    return found
