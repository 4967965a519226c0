"""Completing a launched step: read its tokens back, put them in place, apply the
stop rules, answer, and free what finished.

Everything a step's tokens cause happens here, in one pass over the step's
rows: a sequence's next token (or a verification's accepted tokens,
speculative.py), a beam search's next beams (beam_search.py), the responses
(streamed columns or whole, into the request table's output), and the
iteration and request stats. Requests end through the request table."""

from __future__ import annotations

import time

import numpy as np

from worker.executor import beam_search, prompt_log_probs
from worker.executor.block_manager import BlockManager
from worker.executor.launcher import BEAM, VERIFIED, InFlight
from worker.executor.request_table import Entry, RequestTable
from worker.executor.scheduler import Scheduler
from worker.executor.sequence import Sequence
from worker.executor.speculative import Speculation
from worker.executor.stop_rules import finish_reason
from worker.executor.types import (
    ExecutorConfig,
    FinishReason,
    IterationStats,
    RequestState,
    RequestStats,
    Response,
    Result,
)


class Completion:
    def __init__(self, config: ExecutorConfig, table: RequestTable, scheduler: Scheduler, blocks: BlockManager,
                 speculation: Speculation, max_seq_len: int) -> None:
        self.table = table
        self.scheduler = scheduler
        self.blocks = blocks
        self.speculation = speculation
        self.max_seq_len = max_seq_len
        self.stats_every_request = config.request_stats_max_iterations > 0
        self.iter = 0  # steps completed

    def complete(self, step: InFlight) -> None:
        """Read back a launched step: put its tokens in place, answer, and free what finished."""
        out = step.handle.result()
        for request_id, message in step.errors.items():
            self.table.fail(request_id, message)
        beams: dict[int, Entry] = {}
        if out is not None:
            now = time.monotonic()
            # Python numbers once per step, not a numpy scalar per row.
            tokens, log_probs = out.token_ids.tolist(), out.log_probs.tolist()
            for row, (seq, pos) in enumerate(zip(step.samplers, step.positions, strict=True)):
                if pos == VERIFIED:
                    continue  # a verification row: its sequence's rows are kept together below
                if seq.is_finished:
                    continue  # cancelled, or finished a step earlier: a token nobody wants
                if seq.first_token_time is None:
                    seq.first_token_time = now
                if pos == BEAM:
                    assert out.top_tokens is not None and out.top_log_probs is not None
                    seq.candidates = (out.top_tokens[row], out.top_log_probs[row])
                    entry = self.table.get(seq.request_id)
                    assert entry is not None
                    beams[seq.request_id] = entry
                    continue
                seq.token_ids[pos] = tokens[row]
                seq.num_pending -= 1
                seq.log_probs.append(log_probs[row])
                top_n = seq.request.output_config.top_n_log_probs
                if top_n:
                    assert out.top_tokens is not None and out.top_log_probs is not None
                    seq.top_token_ids.append(out.top_tokens[row, :top_n].tolist())
                    seq.top_log_probs.append(out.top_log_probs[row, :top_n].tolist())
                seq.state = RequestState.GENERATION
                reason = finish_reason(seq, pos + 1, self.max_seq_len)
                if reason is not FinishReason.NOT_FINISHED:
                    seq.finish(reason)
                self.respond(seq)
            for seq, first, drafts in step.verify:
                if not seq.is_finished:
                    if seq.first_token_time is None:
                        seq.first_token_time = now
                    end = first + len(drafts) + 1
                    top = None if out.top_tokens is None or out.top_log_probs is None else (
                        out.top_tokens[first:end], out.top_log_probs[first:end])
                    self.speculation.accept(seq, drafts, tokens[first:end], log_probs[first:end], top)
                    self.respond(seq)
        for entry in beams.values():
            if all(m.candidates is not None for m in entry.seqs):
                self._beam_step(entry)
        for seq in step.batch.seqs:
            if not seq.is_finished:
                self._register_blocks(seq)
        self._record_iteration(step, None if out is None else out.expert_tokens)

    def respond(self, seq: Sequence) -> None:
        """The response this sequence owes now, if any; frees it when finished."""
        request = seq.request
        final = seq.is_finished
        if not (request.streaming or final):
            return
        entry = self.table.get(seq.request_id)
        assert entry is not None
        if final:
            self._register_blocks(seq)  # before they are freed: a request that ends in its first step has none yet
            seq.state = RequestState.FINISHED
            self._record_request(seq)
            self.scheduler.remove(seq)
            entry.done += 1
        # Sliced straight from token_ids: copying all generated tokens first would make
        # every streamed step cost as much as the stream is long.
        num_generated = seq.num_known - seq.num_prompt_tokens
        first = 0 if not request.streaming or request.return_all_generated_tokens else seq.num_emitted
        new, lps = seq.token_ids[seq.num_prompt_tokens + first : seq.num_known], seq.log_probs[first:]
        seq.num_emitted = num_generated
        out_cfg = request.output_config
        output = new if out_cfg.exclude_input_from_output else seq.token_ids[: seq.num_prompt_tokens] + new
        is_final = entry.done == len(entry.seqs)
        if (not final and output and seq.sequence_index == 0 and request.client_id is None
                and not out_cfg.return_log_probs and not out_cfg.top_n_log_probs
                and not out_cfg.return_generation_logits):
            self.table.out.stream(seq.request_id, output)  # the common case, in columns
            return
        want_lp = out_cfg.return_log_probs
        result = Result(
            is_final=is_final,
            output_token_ids=[output],
            finish_reasons=[seq.finish_reason],
            sequence_index=seq.sequence_index,
            is_sequence_final=final,
            cum_log_probs=[float(np.sum(seq.log_probs))] if want_lp else None,
            log_probs=[lps] if want_lp else None,
            top_token_ids=[seq.top_token_ids[first:num_generated]] if out_cfg.top_n_log_probs else None,
            top_log_probs=[seq.top_log_probs[first:num_generated]] if out_cfg.top_n_log_probs else None,
            context_logits=np.stack(seq.context_logits) if final and seq.context_logits else None,
            generation_logits=(np.stack(seq.generation_logits[first:num_generated])[None]
                               if out_cfg.return_generation_logits and num_generated > first else None),
            prompt_log_probs=prompt_log_probs.result(seq) if final else None,
        )
        if is_final:
            self.table.end(seq.request_id)
        self.table.out.responses.append(Response(seq.request_id, result=result, client_id=request.client_id))

    def cancel(self, entry: Entry) -> None:
        """End a request with CANCELLED final responses (its sequences are freed)."""
        if entry.beam is not None:
            self.end_beams(entry, FinishReason.CANCELLED)
            return
        for seq in entry.seqs:
            if not seq.is_finished:
                seq.finish(FinishReason.CANCELLED)
                self.respond(seq)

    # -- beam search --------------------------------------------------------------------------

    def _beam_step(self, entry: Entry) -> None:
        """Every beam has its candidates: pick the next beams (beam_search.advance)
        and, while streaming, report the best running ones."""
        assert entry.beam is not None
        if not beam_search.advance(entry.beam, entry.seqs, self.blocks, self.scheduler):
            self.end_beams(entry, FinishReason.NOT_FINISHED)
        elif entry.request.streaming:  # the best running beams so far (members are in score order)
            best = entry.seqs[: entry.request.num_return_sequences]
            beams = [(m.generated, m.log_probs, FinishReason.NOT_FINISHED) for m in best]
            self.table.out.responses.append(self._beam_response(entry, beams, final=False))

    def end_beams(self, entry: Entry, reason: FinishReason) -> None:
        """Finish a beam search: free every beam, answer with the best hypotheses
        (cut short: the finished ones, else the running beams)."""
        assert entry.beam is not None
        hyps = beam_search.best_hypotheses(entry.beam, entry.seqs, reason)
        for m in entry.seqs:
            m.finish_reason = reason if reason is not FinishReason.NOT_FINISHED else FinishReason.LENGTH
            m.num_pending = 0
            self._register_blocks(m)
            m.state = RequestState.FINISHED
        self._record_request(entry.seqs[0])
        for m in entry.seqs:
            self.scheduler.remove(m)
        self.table.end(entry.request_id)
        self.table.out.responses.append(
            self._beam_response(entry, hyps[: entry.request.num_return_sequences], final=True))

    def _beam_response(self, entry: Entry, beams: list[beam_search.Beam], final: bool) -> Response:
        request = entry.request
        prompt = [] if request.output_config.exclude_input_from_output else list(request.input_token_ids)
        result = beam_search.beam_result(beams, prompt, request.output_config.return_log_probs, final)
        return Response(entry.request_id, result=result, client_id=request.client_id)

    # -- KV blocks and stats --------------------------------------------------------------------

    def _register_blocks(self, seq: Sequence) -> None:
        """Offer seq's computed full blocks to the prefix cache."""
        known = len(seq.token_ids) - seq.num_pending
        self.blocks.register_full_blocks(seq.blocks, seq.token_ids, min(seq.num_computed, known), seq.cache_salt)

    def _record_iteration(self, step: InFlight, expert_tokens: np.ndarray | None) -> None:
        self.iter += 1
        batch = step.batch
        drafted, accepted = self.speculation.take_counts()
        self.table.out.iteration_stats.append(IterationStats(
            timestamp=time.time(),
            iter=self.iter,
            iter_latency_ms=(time.perf_counter() - step.t0) * 1e3,
            num_active_requests=len(self.scheduler.running),
            num_queued_requests=len(self.scheduler.waiting),
            num_context_requests=step.num_context,
            num_generation_requests=len(batch) - step.num_context,
            num_scheduled_tokens=sum(batch.num_new_tokens),
            max_num_blocks=self.blocks.num_blocks,
            free_num_blocks=self.blocks.num_free,
            used_num_blocks=self.blocks.num_blocks - self.blocks.num_free,
            reused_blocks=self.blocks.reused_blocks,
            reused_host_blocks=self.blocks.reused_host_blocks,
            offloaded_blocks=self.blocks.offloaded_blocks,
            max_num_host_blocks=0 if self.blocks.host is None else self.blocks.host.num_blocks,
            cached_num_host_blocks=0 if self.blocks.host is None else self.blocks.host.num_cached,
            num_draft_tokens=drafted,
            num_accepted_draft_tokens=accepted,
            num_preempted=len(batch.preempted),
            expert_tokens=None if expert_tokens is None else expert_tokens.tolist(),
        ))
        if self.stats_every_request:
            for entry in self.table:
                self._record_request(entry.seqs[0])

    def _record_request(self, seq: Sequence) -> None:
        start = seq.arrival_time
        self.table.out.request_stats.append(RequestStats(
            request_id=seq.request_id,
            state=seq.state,
            prompt_tokens=seq.num_prompt_tokens,
            context_prefill_position=min(seq.num_computed, seq.num_prompt_tokens),
            num_generated_tokens=seq.num_generated,
            queue_time_ms=None if seq.first_scheduled_time is None else (seq.first_scheduled_time - start) * 1e3,
            time_to_first_token_ms=None if seq.first_token_time is None else (seq.first_token_time - start) * 1e3,
            allocated_blocks=len(seq.blocks.block_ids),
            reused_blocks=seq.num_cached_prompt // self.blocks.block_size,
            reused_host_blocks=seq.num_host_cached_prompt // self.blocks.block_size,
            num_draft_tokens=0 if seq.spec is None else seq.spec.num_drafted,
            num_accepted_draft_tokens=0 if seq.spec is None else seq.spec.num_accepted,
            speculation_off_reason=seq.speculation_off_reason,
        ))
