"""Launching one engine step, and the rule for when a step may overlap the next.

`Launcher.launch` turns a scheduled batch into the backend's inputs (vectorised
in inputs.py), gives every sampling sequence a placeholder for the token the step
will sample, and starts the step: on the device (an AsyncBackend returns at once,
the tokens come back through the step's handle), on the host (host_logits.py:
post-processors, logits outputs), or computed as it is called (a synchronous
backend). What it returns, an `InFlight`, is completed by completion.py.

`must_complete_first` is the one rule for overlap scheduling: whether the step
in flight must be read back before the next step is scheduled or launched. The
engine core asks it and nothing else decides."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from worker.backends.base import AsyncBackend, Backend, ForwardBatch, SampleOutput, SamplingBatch, StepHandle
from worker.executor import host_logits, kv_transfers
from worker.executor.block_manager import BlockManager
from worker.executor.inputs import build_forward_batch, build_sampling_batch, with_peft_inputs
from worker.executor.lora_registry import LoraRegistry
from worker.executor.penalties import needs_known_tokens
from worker.executor.scheduler import ScheduledBatch
from worker.executor.sequence import Sequence
from worker.executor.types import ExecutorConfig

VERIFIED = -2  # InFlight.positions entry of a verification row (see InFlight.verify)
BEAM = -1  # InFlight.positions entry of a beam: its token comes from the beam step


@dataclass(eq=False, slots=True)
class InFlight:
    """A launched step whose sampled tokens are not read back yet."""

    batch: ScheduledBatch
    samplers: list[Sequence]  # sequences that sample, in row order
    positions: list[int]  # where each sampler's placeholder sits in its token_ids (or VERIFIED, BEAM)
    handle: StepHandle
    num_context: int
    t0: float
    # The next schedule depends on this step's tokens (host sampling, a beam step,
    # a verification, no overlap) or on the drafts that follow them.
    blocking: bool
    errors: dict[int, str] = field(default_factory=dict)  # request id -> its logits post-processor's failure
    # Speculative decoding: (sequence, its first sampler row, its drafts); rows
    # first .. first + len(drafts) are its verification rows.
    verify: list[tuple[Sequence, int, list[int]]] = field(default_factory=list)


def samples(seq: Sequence, n: int) -> bool:
    """Whether a chunk of n tokens reaches the end of seq's tokens (its step samples)."""
    return seq.num_computed + n == seq.num_tokens


def on_host(batch: ScheduledBatch, normalize_log_probs: bool) -> bool:
    """Steps whose logits come to the host: post-processors, logits outputs, normalized log probs."""
    return any(host_logits.context_rows(seq, n) is not None
               or (samples(seq, n) and host_logits.wants_host_logits(seq, normalize_log_probs))
               for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True))


@dataclass(slots=True)
class _Ready:
    """The handle of a step computed as it was launched."""

    output: SampleOutput | None

    def result(self) -> SampleOutput | None:
        return self.output


class Launcher:
    def __init__(self, backend: Backend, config: ExecutorConfig, blocks: BlockManager, lora: LoraRegistry,
                 processors: dict[str, Any]) -> None:
        self.backend = backend
        self.blocks = blocks
        self.lora = lora
        self.processors = processors  # the core's: one registered later is used too
        self.normalize_log_probs = config.normalize_log_probs
        self.vocab_size = backend.config.vocab_size
        asynchronous = isinstance(backend, AsyncBackend)
        self._launch_step = backend.launch if isinstance(backend, AsyncBackend) else self._launch_sync
        overlap = config.overlap_scheduling
        self.overlap = asynchronous if overlap is None else overlap
        self._last_sampled: np.ndarray | None = None  # a synchronous backend's latest tokens

    def must_complete_first(self, step: InFlight, batch: ScheduledBatch | None) -> bool:
        """The rule for overlap: whether `step` must complete before the next step
        launches. With batch None, before anything more is scheduled: the schedule
        depends on its tokens (`InFlight.blocking`), so it completes in the call
        that launched it. With the next batch: building it reads the latest tokens
        (penalties, no-repeat n-grams, multi-token bad words, top-p reset ids,
        grammars), or it runs on the host (a host forward takes no placeholders).
        Otherwise the two overlap: the next step launches while this one runs on
        the device."""
        if batch is None:
            return step.blocking
        return (on_host(batch, self.normalize_log_probs)
                or any(seq.num_pending and needs_known_tokens(seq) for seq in batch.seqs))

    def launch(self, batch: ScheduledBatch, forks: dict[Sequence, list[Sequence]]) -> InFlight:
        """Launch one step; `forks`: the siblings that sample beside their leader
        (siblings.py). Steps that need the logits on the host sample there."""
        t0 = time.perf_counter()
        host = on_host(batch, self.normalize_log_probs)
        num_context = sum(1 for seq in batch.seqs if seq.in_prefill)
        samplers: list[Sequence] = []
        rows: list[int] = []
        extra: list[tuple[Sequence, int, int]] = []  # (seq, first position, count) of context logits
        verify: list[tuple[Sequence, int, list[int]]] = []
        offsets: list[int] = []  # per sampler row: output positions past the sequence's next one
        offset = 0
        beam_step = False
        for seq, n, drafts in zip(batch.seqs, batch.num_new_tokens, batch.drafts, strict=True):
            if host and (ctx := host_logits.context_rows(seq, n)) is not None:
                extra.append((seq, offset + ctx[0] - seq.num_computed, ctx[1]))
            offset += n
            if drafts:  # a verification row for the last token and each draft
                verify.append((seq, len(samplers), drafts))
                samplers += [seq] * (len(drafts) + 1)
                offsets += range(len(drafts) + 1)
                rows.append(len(drafts) + 1)
                continue
            if not samples(seq, n):
                rows.append(0)
                continue
            # Beams pick their next tokens on the host from every beam's candidates.
            beam_step = beam_step or (seq.family is not None and seq.family.is_beam)
            group = [seq, *forks[seq]] if forks and seq in forks else [seq]
            samplers += group
            offsets += [0] * len(group)
            rows.append(len(group))
        forward = build_forward_batch(batch, self.blocks.block_size, rows, [(a, c) for _, a, c in extra])
        if any(seq.adapter is not None or seq.prompt_table is not None for seq in batch.seqs):
            slots = [-1 if seq.adapter is None else self.lora.on().slot(seq.adapter) for seq in batch.seqs]
            forward = with_peft_inputs(forward, batch, slots, self.vocab_size)
        sampling = build_sampling_batch(samplers, offsets if verify else None) if samplers else None
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed += n
        # Each sampler gets a placeholder for the token this step will sample;
        # beams get theirs from the beam step, once every beam has its candidates.
        positions = []
        verified = {seq for seq, _, _ in verify}
        drafts_follow = False  # a speculating sequence's next drafts follow this step's token
        for row, seq in enumerate(samplers):
            if seq in verified:  # its tokens are kept at completion, once the acceptance is known
                positions.append(VERIFIED)
                continue
            if seq.family is not None and seq.family.is_beam:
                positions.append(BEAM)
                continue
            seq.token_ids.append(-(row + 1))
            seq.num_pending += 1
            positions.append(len(seq.token_ids) - 1)
            drafts_follow = drafts_follow or seq.spec is not None
        kv_transfers.issue(self.blocks.take_transfers(), self.backend)  # before anything writes those blocks
        if batch.copies:
            src, dst = zip(*batch.copies, strict=True)
            self.backend.copy_blocks(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64))
        errors: dict[int, str] = {}
        if host:
            handle: StepHandle = self._host_step(forward, sampling, samplers, extra, errors)
        else:
            handle = self._launch_step(forward, sampling)
        # How many tokens a verification keeps is known only once it is read back.
        blocking = host or beam_step or not self.overlap or bool(verify) or drafts_follow
        return InFlight(batch, samplers, positions, handle, num_context, t0, blocking, errors, verify)

    def _host_step(self, forward: ForwardBatch, sampling: SamplingBatch | None, samplers: list[Sequence],
                   extra: list[tuple[Sequence, int, int]], errors: dict[int, str]) -> _Ready:
        logits = self.backend.logits_to_host(self.backend.forward(forward))
        out = host_logits.sample(logits, sampling, samplers, extra, self.processors, self.normalize_log_probs,
                                 errors)
        self._last_sampled = None if out is None else out.token_ids
        return _Ready(out)

    def _launch_sync(self, batch: ForwardBatch, sampling: SamplingBatch | None) -> StepHandle:
        """AsyncBackend.launch for a backend that computes as it is called."""
        ids = batch.token_ids
        pending = ids < 0
        if pending.any():
            assert self._last_sampled is not None, "a placeholder with no previous step"
            ids = ids.copy()
            ids[pending] = self._last_sampled[-ids[pending] - 1]
            batch = replace(batch, token_ids=ids)
        logits = self.backend.forward(batch)
        out = None if sampling is None else self.backend.sample(logits, sampling)
        self._last_sampled = None if out is None else out.token_ids
        return _Ready(out)
