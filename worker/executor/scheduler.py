"""Which sequences run in the next iteration, and with how many tokens each.

Generation steps go first (one token each, plus the draft tokens of sequences
that speculate), then unfinished context chunks, then new requests by priority,
all under a per-iteration token budget. The capacity policy decides what
happens when KV blocks are short.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.executor import prompt_log_probs
from worker.executor.block_manager import BlockManager, OutOfBlocksError
from worker.executor.sequence import Sequence
from worker.executor.types import CapacitySchedulerPolicy, ExecutorConfig, RequestState


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # Draft tokens each sequence's generation step verifies after its last token
    # (speculative decoding; empty for the others): they are the step's last
    # len(drafts[i]) tokens of num_new_tokens[i], and not in seq.token_ids.
    drafts: list[list[int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (source, destination) KV blocks the backend copies before the step runs:
    # copy-on-write of blocks that forked sequences shared.
    copies: list[tuple[int, int]] = field(default_factory=list)

    def add(self, seq: Sequence, n: int, drafts: list[int] | None = None) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        self.drafts.append(drafts or [])

    @property
    def has_drafts(self) -> bool:
        return any(self.drafts)

    def __len__(self) -> int:
        return len(self.seqs)

    def drop_finished(self) -> None:
        """Take out sequences that finished after being scheduled (the step in
        flight was completed first); their blocks are already free."""
        keep = [i for i, seq in enumerate(self.seqs) if not seq.is_finished]
        if len(keep) < len(self.seqs):
            self.seqs = [self.seqs[i] for i in keep]
            self.num_new_tokens = [self.num_new_tokens[i] for i in keep]
            self.drafts = [self.drafts[i] for i in keep]


def _order(seq: Sequence) -> tuple[float, float]:
    # Higher priority first, then first come first served.
    return (-seq.request.priority, seq.arrival_time)


class Scheduler:
    def __init__(self, config: ExecutorConfig, blocks: BlockManager) -> None:
        self.max_batch_size = config.max_batch_size
        self.max_num_tokens = config.max_num_tokens
        self.chunked = config.enable_chunked_context
        self.policy = config.scheduler_config.capacity_scheduler_policy
        self.blocks = blocks
        self.waiting: list[Sequence] = []  # kept sorted by _order
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        # LoRA: whether a waiting sequence's adapter has its device slot now (the engine's
        # adapter cache puts it there); one that does not yet is passed over.
        self.adapter_ready: Callable[[Sequence], bool] = lambda seq: True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_order)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one: it holds blocks already."""
        seq.state = RequestState.GENERATION
        self.running.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """Back to waiting with no KV (it will recompute its tokens)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.blocks)
        seq.num_computed = 0
        seq.state = RequestState.PREEMPTED
        self.add(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or cancelled) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.blocks)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_tokens

        # 1. Generation steps: the last token, and the drafts proposed for it
        # (seq.draft) as far as the budget goes. A sequence may be preempted by one
        # scheduled later in this loop only under MAX_UTILIZATION, so iterate over a snapshot
        # (and skip the preempted by their state: a list lookup per sequence is quadratic).
        for seq in list(self.running):
            # A sequence at max_tokens only waits for its last token to come back.
            # A beam waiting for its siblings' candidates has no new token yet.
            if (seq.in_prefill or seq.reached_max_tokens or seq.num_uncomputed == 0
                    or seq.state is RequestState.PREEMPTED or budget == 0):
                continue
            drafts = seq.draft[: budget - 1]
            if drafts and not self.blocks.can_grow(seq.blocks, seq.num_computed + 1 + len(drafts)):
                drafts = []  # drafts are optional: they never preempt anyone
            n = 1 + len(drafts)
            if not self._grow(seq, seq.num_computed + n, batch):
                continue
            batch.add(seq, n, drafts)
            budget -= n

        # 2. Context chunks of admitted sequences.
        for seq in self.running:
            if budget == 0:
                break
            if seq.in_prefill:
                n = self._chunk(seq, budget)
                if n:
                    batch.add(seq, n)
                    budget -= n

        # 3. New (or preempted) sequences, by priority. What the running requests may
        # still take is counted once, then kept up to date as each is admitted.
        guaranteed = self.policy is CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
        reserved = self._reserved() if guaranteed and self.waiting else 0
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[i]
            if seq.adapter is not None and not self.adapter_ready(seq):
                i += 1  # its LoRA adapter is loading or every slot is busy: the others go on
                continue
            # A sequence preempted with a token still being sampled waits for it:
            # its recompute and its prefix lookup need the real id.
            if seq.num_pending or not self._admit(seq, reserved):
                break
            n = self._chunk(seq, budget)
            if n == 0:
                self.blocks.free(seq.blocks)
                seq.num_computed = 0
                break
            self.waiting.pop(i)
            self.running.append(seq)
            if guaranteed:
                reserved += self._reservation(seq)
            seq.state = RequestState.CONTEXT
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            batch.add(seq, n)
            budget -= n
        return batch

    # -- helpers ---------------------------------------------------------------

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_uncomputed, budget)
        if n < seq.num_uncomputed and not self.chunked:
            return 0
        return n

    def _admit(self, seq: Sequence, reserved: int) -> bool:
        """Reserve KV blocks for a waiting sequence, if the policy allows; `reserved`:
        what the running requests may still take (_reserved())."""
        # Context logits (and prompt log probs) need every prompt token computed: no prefix-cache lookup.
        wants_logits = prompt_log_probs.wants_rows(seq) and (
            prompt_log_probs.rows_collected(seq) < seq.num_prompt_tokens)
        lookup = seq.token_ids[:1] if wants_logits else seq.token_ids
        hits = self.blocks.cached_prefix(lookup, seq.cache_salt)
        need_now = self.blocks.free_blocks_needed(hits, seq.num_tokens)
        if self.policy is CapacitySchedulerPolicy.GUARANTEED_NO_EVICT:
            # A request that forks (beams, returned sequences) reserves as if none
            # of its sequences shared a block: never too little, whatever they share.
            width = seq.family.width if seq.family is not None else 1
            future = width * self.blocks.blocks_for(seq.max_total_tokens) - self.blocks.blocks_for(seq.num_tokens)
            if need_now + future + reserved > self.blocks.num_free:
                return False
        elif need_now > self.blocks.num_free:
            return False
        cached = self.blocks.allocate_prompt(seq.blocks, lookup, seq.num_tokens, seq.cache_salt)
        seq.num_computed = cached
        if seq.state is RequestState.QUEUED:
            seq.num_cached_prompt = cached
            seq.num_host_cached_prompt = seq.blocks.num_from_host * self.blocks.block_size
        return True

    def _reserved(self) -> int:
        """Blocks the running requests may still take (_reservation of each)."""
        reserved = 0
        seen: set[int] = set()
        for s in self.running:
            if s.family is not None:
                if id(s.family) in seen:
                    continue  # a family reserves once
                seen.add(id(s.family))
            reserved += self._reservation(s)
        return reserved

    def _reservation(self, seq: Sequence) -> int:
        """Blocks seq's request (family) may still take: width x blocks at max length,
        less the distinct blocks it holds."""
        family = seq.family
        if family is None:
            return self.blocks.blocks_for(seq.max_total_tokens) - len(seq.blocks.block_ids)
        held = {b for m in family.members for b in m.blocks.block_ids}
        return family.width * self.blocks.blocks_for(seq.max_total_tokens) - len(held)

    def _grow(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Make room for num_tokens in seq's table (copying a shared block it is
        about to write), preempting under MAX_UTILIZATION."""
        while True:
            try:
                self.blocks.ensure_capacity(seq.blocks, num_tokens)
                copy = self.blocks.make_writable(seq.blocks, seq.num_computed)
                if copy is not None:
                    batch.copies.append(copy)
                return True
            except OutOfBlocksError:
                if self.policy is CapacitySchedulerPolicy.GUARANTEED_NO_EVICT:
                    raise  # admission reserved these blocks: running out is a bug
                victim = max(self.running, key=_order)  # lowest priority, newest
                self._preempt(victim, batch)
                if victim is seq:
                    return False

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Drop seq's KV and requeue it; it resumes by recomputing its tokens."""
        self.running.remove(seq)
        if seq in batch.seqs:
            i = batch.seqs.index(seq)
            del batch.seqs[i], batch.num_new_tokens[i], batch.drafts[i]
        self.blocks.free(seq.blocks)
        seq.num_computed = 0
        seq.state = RequestState.PREEMPTED
        self.num_preemptions += 1
        batch.preempted.append(seq)
        self.add(seq)
