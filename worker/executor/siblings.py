"""The returned sequences of a sampling request with num_return_sequences > 1.

Intake makes all of them; only the leader queues. The others wait here until the
step that computes the leader's last prompt token is scheduled: then they fork
the leader's KV blocks, join the running sequences and sample with it from the
same logits, so the prompt is computed once. Forking is done between scheduling
and launch, so the launcher only reads what the schedule holds."""

from __future__ import annotations

from worker.executor.block_manager import BlockManager
from worker.executor.scheduler import ScheduledBatch, Scheduler
from worker.executor.sequence import Sequence


class Siblings:
    def __init__(self, blocks: BlockManager, scheduler: Scheduler) -> None:
        self.blocks = blocks
        self.scheduler = scheduler
        self._waiting: dict[Sequence, list[Sequence]] = {}  # leader -> its siblings, until they fork
        self._sweep_at = 64  # size at which leaders that ended before forking are dropped

    def add(self, seqs: list[Sequence]) -> None:
        """A new request's sequences, leader first (beams fork in the beam step instead)."""
        if len(seqs) > 1:
            self._waiting[seqs[0]] = seqs[1:]
        if len(self._waiting) >= self._sweep_at:
            # A request cancelled in the queue never forks. Sweeping when the table has
            # doubled costs O(1) a request, where a sweep every step would cost O(queue).
            self._waiting = {lead: sibs for lead, sibs in self._waiting.items() if not lead.is_finished}
            self._sweep_at = max(64, 2 * len(self._waiting))

    def fork(self, batch: ScheduledBatch) -> dict[Sequence, list[Sequence]]:
        """Fork the siblings of the leaders whose prompt `batch` completes; returns
        leader -> the siblings that sample beside it in this step."""
        if not self._waiting:
            return {}
        forks: dict[Sequence, list[Sequence]] = {}
        for leader, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            siblings = self._waiting.get(leader)
            if siblings is None or leader.num_computed + n != leader.num_tokens:
                continue
            del self._waiting[leader]
            family = leader.family
            assert family is not None
            forks[leader] = live = [s for s in siblings if not s.is_finished]
            for sib in live:
                sib.blocks = self.blocks.fork(leader.blocks)
                sib.num_computed = leader.num_computed + n
                sib.first_scheduled_time = leader.first_scheduled_time
                sib.num_cached_prompt = leader.num_cached_prompt
                sib.num_host_cached_prompt = leader.num_host_cached_prompt
                self.scheduler.add_running(sib)
                family.members.append(sib)
        return forks
