"""Beam search bookkeeping for one request, on the host, over the candidates
the batched sampler returns (each beam's most likely next tokens).

The rules are transformers' `generate(num_beams=...)` (the test oracle): every
step keeps the 2W best continuations of all W beams by cumulative log prob;
those among the best W that end (end id, stop word, or max_tokens) become
finished hypotheses scored cum_log_prob / length ** length_penalty (the W best
are kept), and the W best that do not end continue. The search stops when all
continuations end, when W hypotheses are finished and early stopping is on,
or when no running beam can beat the worst finished one (early_stopping 0: at
its current length; -1, "never": at max_tokens when length_penalty > 0).
`beam_search_diversity_rate` (TensorRT-LLM) lowers each beam's k-th best
candidate by rate * k before the beams compete, favouring distinct parents.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from worker.executor.block_manager import BlockManager, BlockTable
from worker.executor.scheduler import Scheduler
from worker.executor.sequence import Sequence
from worker.executor.types import FinishReason, RequestState, Result

# A beam as reported: its generated tokens, their log probs, why it ended.
Beam = tuple[list[int], list[float], FinishReason]

_DEAD = -1.0e9  # transformers' score for beams that cannot continue


@dataclass(slots=True)
class Hypothesis:
    tokens: list[int]  # generated tokens, the ending one included
    log_probs: list[float]
    score: float  # cum log prob / length ** length_penalty
    reason: FinishReason

    @property
    def cum_log_prob(self) -> float:
        return float(sum(self.log_probs))


@dataclass(slots=True)
class Continuation:
    parent: int  # index of the beam it extends
    token: int
    log_prob: float
    score: float  # cumulative log prob used for ranking


@dataclass(slots=True)
class BeamSearch:
    width: int
    max_tokens: int
    length_penalty: float = 0.0
    early_stopping: int = 1  # 1: stop at W finished; 0: heuristic; < 0: never
    diversity_rate: float = 0.0
    scores: np.ndarray = field(default_factory=lambda: np.zeros(1))  # running beams' cumulative scores
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    improvable: bool = True
    done: bool = False

    def step(
        self,
        tokens: np.ndarray,
        log_probs: np.ndarray,
        generated: list[list[int]],
        beam_log_probs: list[list[float]],
        ends: Callable[[int, int], FinishReason],
    ) -> list[Continuation]:
        """One step. tokens / log_probs [B, K]: each running beam's K >= 2W best
        next tokens, most likely first; generated / beam_log_probs: each beam's
        tokens and their log probs so far; ends(beam, token): the reason that
        token ends that beam, if it does. Returns the W beams that continue."""
        w = self.width
        num_beams, k = tokens.shape
        acc = self.scores[:num_beams, None] + log_probs.astype(np.float64)
        if self.diversity_rate:
            acc = acc - self.diversity_rate * np.arange(k)[None, :]
        flat = acc.reshape(-1)
        top = np.argsort(-flat, kind="stable")[: 2 * w]
        length = len(generated[0]) + 1
        reasons = []
        for i in top:
            reason = ends(int(i // k), int(tokens.flat[i]))
            if reason is FinishReason.NOT_FINISHED and length >= self.max_tokens:
                reason = FinishReason.LENGTH
            reasons.append(reason)
        hits = np.array([r is not FinishReason.NOT_FINISHED for r in reasons])

        # The W best that do not end continue.
        running = flat[top] + hits * _DEAD
        keep = np.argsort(-running, kind="stable")[:w]
        continuations = [
            Continuation(int(top[j] // k), int(tokens.flat[top[j]]), float(log_probs.flat[top[j]]), float(running[j]))
            for j in keep
        ]

        # Those among the W best that end become hypotheses, if they still may.
        full = len(self.finished) == w
        if self.improvable and not (full and self.early_stopping == 1):
            for j in range(min(w, len(top))):
                if not hits[j]:
                    continue
                beam = int(top[j] // k)
                token = int(tokens.flat[top[j]])
                self.finished.append(Hypothesis(
                    generated[beam] + [token], beam_log_probs[beam] + [float(log_probs.flat[top[j]])],
                    float(flat[top[j]]) / length**self.length_penalty, reasons[j]))
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[w:]

        self.scores = np.array([c.score for c in continuations])
        if len(self.finished) == w:
            never = self.early_stopping < 0 and self.length_penalty > 0
            best_possible = self.scores[0] / (self.max_tokens if never else length) ** self.length_penalty
            self.improvable = self.improvable and bool(best_possible > self.finished[-1].score)
        self.done = (
            not self.improvable
            or (len(self.finished) == w and self.early_stopping == 1)
            or bool(hits.all())
        )
        return continuations


def _ends(seq: Sequence, token: int) -> FinishReason:
    """Why appending `token` would end beam `seq`, if it would."""
    if token == seq.end_id:
        return FinishReason.END_ID
    generated = [*seq.generated, token]
    for word in seq.stop_words:
        if len(word) <= len(generated) and generated[len(generated) - len(word) :] == word:
            return FinishReason.STOP_WORDS
    return FinishReason.NOT_FINISHED


def advance(search: BeamSearch, members: list[Sequence], blocks: BlockManager, scheduler: Scheduler) -> bool:
    """Every beam of a request has its candidates: pick the next beams and give each
    its parent's tokens and KV blocks (shared, copied on write). `members` (the live
    beams) is updated in place, best first. False when the search is over."""
    k = 2 * search.width
    tokens = np.stack([m.candidates[0][:k] for m in members])  # type: ignore[index]
    log_probs = np.stack([m.candidates[1][:k] for m in members])  # type: ignore[index]
    for m in members:
        m.candidates = None
    continuations = search.step(tokens, log_probs, [m.generated for m in members],
                                [m.log_probs for m in members], lambda b, t: _ends(members[b], t))
    if search.done:
        return False
    running = set(map(id, scheduler.running))
    parents = [(m.token_ids, m.log_probs, m.num_computed, id(m) in running and m.num_computed == m.num_tokens)
               for m in members]
    tables = [blocks.fork(members[c.parent].blocks) if parents[c.parent][3] else BlockTable()
              for c in continuations]
    for m in members:
        blocks.free(m.blocks)
    family = members[0].family
    assert family is not None
    for j, c in enumerate(continuations):
        tokens_so_far, lps, computed, has_kv = parents[c.parent]
        if j < len(members):
            slot = members[j]
        else:
            slot = replace(members[0], blocks=BlockTable(), candidates=None, state=RequestState.GENERATION,
                           top_token_ids=[], top_log_probs=[], context_logits=[], generation_logits=[])
            members.append(slot)
            family.members.append(slot)
        slot.blocks = tables[j]
        slot.token_ids = [*tokens_so_far, c.token]
        slot.log_probs = [*lps, c.log_prob]
        slot.num_computed = computed if has_kv else 0
        if j >= len(parents):
            if has_kv:
                scheduler.add_running(slot)
            else:
                scheduler.add(slot)
        elif id(slot) in running and not has_kv:
            scheduler.requeue(slot)
        elif id(slot) not in running and slot.blocks.block_ids:
            blocks.free(slot.blocks)  # it waits: it will recompute
            slot.num_computed = 0
    return True


def best_hypotheses(search: BeamSearch, members: list[Sequence], reason: FinishReason) -> list[Beam]:
    """What a finished search reports, best first: its hypotheses; if it was cut
    short (`reason`), the finished ones or else the running beams, marked so."""
    hyps: list[Beam] = [(h.tokens, h.log_probs, h.reason) for h in search.finished]
    if reason is not FinishReason.NOT_FINISHED:
        found = hyps or [(m.generated, m.log_probs, reason) for m in members]
        hyps = [(tokens, lps, reason) for tokens, lps, _ in found]
    return hyps


def beam_result(beams: list[Beam], prompt: list[int], want_log_probs: bool, final: bool) -> Result:
    return Result(
        is_final=final,
        output_token_ids=[prompt + tokens for tokens, _, _ in beams],
        finish_reasons=[reason for _, _, reason in beams],
        sequence_index=0,
        is_sequence_final=final,
        cum_log_probs=[float(np.sum(lps)) for _, lps, _ in beams] if want_log_probs else None,
        log_probs=[list(lps) for _, lps, _ in beams] if want_log_probs else None,
    )
