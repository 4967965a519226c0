"""The Executor: enqueue requests, await responses, cancel, stats.

One thread owns the model and runs the loop: take new requests and cancels,
schedule, one forward over the packed batch, sample, append, respond, free.
Callers only touch the queues guarded by `self._lock`; no I/O in the loop.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence as Seq
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, overload

import numpy as np

from worker.backends.base import Backend, ForwardBatch, SampleOutput, SamplingBatch, StepHandle
from worker.executor.block_manager import BlockManager
from worker.executor.inputs import build_forward_batch, build_sampling_batch
from worker.executor.scheduler import ScheduledBatch, Scheduler
from worker.executor.sequence import Sequence
from worker.executor.types import (
    ExecutorConfig,
    FinishReason,
    IterationStats,
    Request,
    RequestState,
    RequestStats,
    Response,
    Result,
)
from worker.executor.validation import RequestError, normalize_word_list, validate_request

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class _Entry:
    """A request in flight: its sequences (one per returned sequence)."""

    request_id: int
    request: Request
    seqs: list[Sequence]
    enqueue_time: float = field(default_factory=time.monotonic)
    done: int = 0  # sequences that sent their last response


@dataclass(eq=False, slots=True)
class _InFlight:
    """A launched step whose sampled tokens are not read back yet."""

    batch: ScheduledBatch
    samplers: list[Sequence]  # sequences that sample, in row order
    positions: list[int]  # where each sampler's placeholder sits in its token_ids
    handle: StepHandle
    num_context: int
    t0: float


@dataclass(slots=True)
class _Ready:
    output: SampleOutput | None

    def result(self) -> SampleOutput | None:
        return self.output


def _needs_known_tokens(batch: ScheduledBatch) -> bool:
    """Multi-token bad words look at the latest token before sampling: a batch
    with such a sequence waits for the step in flight instead of overlapping it."""
    return any(seq.num_pending and any(len(w) > 1 for w in seq.bad_words) for seq in batch.seqs)


class Executor:
    def __init__(
        self,
        model: str | Path,
        config: ExecutorConfig | None = None,
        *,
        backend: Backend | None = None,
        tokenizer: Any = None,
    ) -> None:
        """Load `model` (checkpoint dir, .gguf file or the default model's name)
        onto the backend `config.backend` picks; tests and transport benchmarks
        may pass a ready `backend` (and its `tokenizer`) instead."""
        self.config = config or ExecutorConfig()
        if backend is None:
            from worker.backends.device import create_backend
            from worker.models.loader import load_model

            path = Path(model)
            if not path.exists():  # a model name, such as the default model's
                from worker.models.default_model import resolve_model

                path = resolve_model(str(model))
            loaded = load_model(path)
            backend = create_backend(loaded, self.config.backend, self.config.device, self.config.dtype)
            tokenizer = loaded.tokenizer
            self.chat_template: str | None = loaded.chat_template
        else:
            self.chat_template = None
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_config = backend.config
        self.max_seq_len = self.model_config.max_position_embeddings

        kv = self.config.kv_cache_config
        num_blocks = self._num_kv_blocks()
        self.backend.allocate_kv_cache(num_blocks, kv.tokens_per_block)
        self.blocks = BlockManager(num_blocks, kv.tokens_per_block, kv.enable_block_reuse)
        self.scheduler = Scheduler(self.config, self.blocks)
        launch = getattr(backend, "launch", None)
        self._launch_step = launch or self._launch_sync
        overlap = self.config.overlap_scheduling
        self._overlap = launch is not None if overlap is None else overlap
        self._last_sampled: np.ndarray | None = None
        log.info("executor: backend=%s kv_blocks=%d x %d tokens", backend.name, num_blocks, kv.tokens_per_block)

        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._incoming: deque[_Entry] = deque()
        self._cancels: set[int] = set()
        self._responses: list[Response] = []
        self._entries: dict[int, _Entry] = {}  # owned by the loop thread
        self._iteration_stats: deque[IterationStats] = deque(maxlen=self.config.iteration_stats_max)
        self._request_stats: deque[RequestStats] = deque(maxlen=self.config.iteration_stats_max)
        self._iter = 0
        self._shutdown = False
        self._thread = threading.Thread(target=self._loop, name="executor", daemon=True)
        self._thread.start()

    # -- public API --------------------------------------------------------------

    def enqueue_request(self, request: Request) -> int:
        return self.enqueue_requests([request])[0]

    def enqueue_requests(self, requests: Iterable[Request]) -> list[int]:
        """Ids for the requests; an invalid request gets an error response, not an exception."""
        ids: list[int] = []
        entries: list[_Entry] = []
        errors: list[Response] = []
        for request in requests:
            request_id = next(self._ids)
            ids.append(request_id)
            try:
                entries.append(self._make_entry(request_id, request))
            except RequestError as e:
                errors.append(Response(request_id, error_msg=str(e), client_id=request.client_id))
        with self._lock:
            if self._shutdown:
                raise RuntimeError("executor is shut down")
            self._incoming.extend(entries)
            self._responses.extend(errors)
            self._lock.notify_all()
        return ids

    @overload
    def await_responses(self, id_or_ids: int | None = None, timeout: float | None = None) -> list[Response]: ...
    @overload
    def await_responses(self, id_or_ids: Seq[int], timeout: float | None = None) -> list[list[Response]]: ...

    def await_responses(
        self, id_or_ids: int | Seq[int] | None = None, timeout: float | None = None
    ) -> list[Response] | list[list[Response]]:
        """Responses ready for one id, for each of several ids, or for any id.
        Waits up to `timeout` seconds (None: until something is ready)."""
        wanted: set[int] | None
        if id_or_ids is None:
            wanted = None
        elif isinstance(id_or_ids, int):
            wanted = {id_or_ids}
        else:
            wanted = set(id_or_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                ready = [r for r in self._responses if wanted is None or r.request_id in wanted]
                if ready or self._shutdown:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._lock.wait(remaining)
            if ready:
                taken = {id(r) for r in ready}
                self._responses = [r for r in self._responses if id(r) not in taken]
        if id_or_ids is None or isinstance(id_or_ids, int):
            return ready
        return [[r for r in ready if r.request_id == i] for i in id_or_ids]

    def cancel_request(self, request_id: int) -> None:
        with self._lock:
            self._cancels.add(request_id)
            self._lock.notify_all()

    def get_latest_iteration_stats(self) -> list[IterationStats]:
        with self._lock:
            stats = list(self._iteration_stats)
            self._iteration_stats.clear()
        return stats

    def get_latest_request_stats(self) -> list[RequestStats]:
        with self._lock:
            stats = list(self._request_stats)
            self._request_stats.clear()
        return stats

    def load(self) -> tuple[int, int, int]:
        """(queued, active, free KV blocks), cheap enough for every heartbeat."""
        with self._lock:
            queued = len(self._incoming) + len(self.scheduler.waiting)
            return queued, len(self.scheduler.running), self.blocks.num_free

    def shutdown(self) -> None:
        with self._lock:
            self._shutdown = True
            self._lock.notify_all()
        self._thread.join()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- request intake ------------------------------------------------------------

    def _num_kv_blocks(self) -> int:
        kv = self.config.kv_cache_config
        if kv.max_tokens is not None:
            tokens = kv.max_tokens
        else:
            per_token = self.backend.kv_bytes_per_token()
            tokens = int(kv.free_memory_fraction * self.backend.free_memory_bytes()) // per_token
            # More KV than every batch slot at full context is never used.
            tokens = min(tokens, self.config.max_batch_size * self.max_seq_len)
        return max(1, tokens // kv.tokens_per_block)

    def _make_entry(self, request_id: int, request: Request) -> _Entry:
        validate_request(request, self.model_config, self.config, self.max_seq_len)
        kv = self.config.kv_cache_config
        need = -(-(len(request.input_token_ids) + request.max_tokens) // kv.tokens_per_block)
        total = self._num_kv_blocks()
        if need > total:
            raise RequestError(
                f"request needs {need} KV cache blocks for prompt + max_tokens, but the cache holds {total}"
            )
        cfg = request.sampling_config
        eos = self.model_config.eos_token_ids
        end_id = request.end_id if request.end_id is not None else (eos[0] if eos else -1)
        greedy = cfg.is_greedy
        params = (
            0.0 if greedy else (1.0 if cfg.temperature is None else cfg.temperature),
            float(cfg.top_k or 0),
            1.0 if cfg.top_p is None else cfg.top_p,
            cfg.min_p or 0.0,
        )
        seed = cfg.seed if cfg.seed is not None else random.getrandbits(63)
        stop_words = normalize_word_list(request.stop_words, "stop_words")
        bad_words = normalize_word_list(request.bad_words, "bad_words")
        seqs = [
            Sequence(
                request_id=request_id,
                request=request,
                token_ids=list(request.input_token_ids),
                num_prompt_tokens=len(request.input_token_ids),
                end_id=end_id,
                stop_words=stop_words,
                bad_words=bad_words,
                seed=seed,
                sampling_params=params,
                sequence_index=i,
            )
            for i in range(request.num_return_sequences)
        ]
        return _Entry(request_id, request, seqs)

    # -- the loop ----------------------------------------------------------------------

    def _loop(self) -> None:
        inflight: _InFlight | None = None
        while True:
            with self._lock:
                while not (self._shutdown or self._incoming or self._cancels or self.scheduler.has_work or inflight):
                    self._lock.wait()
                if self._shutdown:
                    return
                incoming = list(self._incoming)
                self._incoming.clear()
                cancels = self._cancels
                self._cancels = set()
            for entry in incoming:
                self._entries[entry.request_id] = entry
                for seq in entry.seqs:
                    self.scheduler.add(seq)
            responses = [r for rid in cancels for r in self._cancel(rid)]
            try:
                # Step N+1 is scheduled and launched before step N's tokens are
                # read back, so the device never waits for this thread.
                batch = self.scheduler.schedule()
                launched = None
                if batch:
                    if inflight is not None and _needs_known_tokens(batch):
                        responses += self._complete(inflight)
                        inflight = None
                    launched = self._launch(batch)
                    if not self._overlap:
                        responses += self._complete(launched)
                        launched = None
                if inflight is not None:
                    responses += self._complete(inflight)
                inflight = launched
                if not batch and inflight is None and self.scheduler.has_work:
                    time.sleep(0.001)  # nothing fits yet; wait for cancels or new room
            except Exception as e:  # a backend failure ends what ran, not the executor
                log.exception("executor step failed")
                inflight = None
                responses += self._fail_running(f"internal error in the executor step: {e}")
            if responses:
                with self._lock:
                    self._responses.extend(responses)
                    self._lock.notify_all()

    def _launch(self, batch: ScheduledBatch) -> _InFlight:
        t0 = time.perf_counter()
        num_context = sum(1 for seq in batch.seqs if seq.in_prefill)
        forward = build_forward_batch(batch, self.blocks.block_size)
        samplers = [seq for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
                    if seq.num_computed + n == seq.num_tokens]
        sampling = build_sampling_batch(samplers) if samplers else None
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed += n
        # Each sampler gets a placeholder for the token this step will sample.
        positions = []
        for row, seq in enumerate(samplers):
            seq.token_ids.append(-(row + 1))
            seq.num_pending += 1
            positions.append(len(seq.token_ids) - 1)
        handle = self._launch_step(forward, sampling)
        return _InFlight(batch, samplers, positions, handle, num_context, t0)

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

    def _complete(self, step: _InFlight) -> list[Response]:
        """Read back a step's tokens, put them in place, answer and free what finished."""
        out = step.handle.result()
        responses: list[Response] = []
        if out is not None:
            now = time.monotonic()
            for seq, pos, token, lp in zip(step.samplers, step.positions, out.token_ids.tolist(),
                                           out.log_probs.tolist(), strict=True):
                if seq.is_finished:
                    continue  # cancelled, or finished a step earlier: a token nobody wants
                seq.token_ids[pos] = token
                seq.num_pending -= 1
                seq.log_probs.append(lp)
                seq.state = RequestState.GENERATION
                if seq.first_token_time is None:
                    seq.first_token_time = now
                reason = self._finish_reason(seq, pos + 1)
                if reason is not FinishReason.NOT_FINISHED:
                    self._finish(seq, reason)
                response = self._respond(seq)
                if response is not None:
                    responses.append(response)
        for seq in step.batch.seqs:
            if not seq.is_finished:
                known = len(seq.token_ids) - seq.num_pending
                self.blocks.register_full_blocks(seq.blocks, seq.token_ids, min(seq.num_computed, known))
        self._record_iteration(step.batch, step.num_context, step.t0)
        return responses

    def _finish_reason(self, seq: Sequence, length: int) -> FinishReason:
        """Why the sequence ends at token_ids[:length], if it does."""
        tokens = seq.token_ids
        if tokens[length - 1] == seq.end_id:
            return FinishReason.END_ID
        generated = length - seq.num_prompt_tokens
        for word in seq.stop_words:
            if len(word) <= generated and tokens[length - len(word) : length] == word:
                return FinishReason.STOP_WORDS
        if generated >= seq.request.max_tokens or length >= self.max_seq_len:
            return FinishReason.LENGTH
        return FinishReason.NOT_FINISHED

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark seq finished; drop placeholders of steps still in flight."""
        seq.finish_reason = reason
        if seq.num_pending:
            del seq.token_ids[len(seq.token_ids) - seq.num_pending :]
            seq.num_pending = 0

    def _respond(self, seq: Sequence) -> Response | None:
        """The response this sequence owes now, if any; frees it when finished."""
        request = seq.request
        final = seq.is_finished
        if not (request.streaming or final):
            return None
        entry = self._entries[seq.request_id]
        if final:
            self._record_request(seq)
            self.scheduler.remove(seq)
            seq.state = RequestState.FINISHED
            entry.done += 1
        generated = seq.generated
        if request.streaming and not request.return_all_generated_tokens:
            new = generated[seq.num_emitted :]
            lps = seq.log_probs[seq.num_emitted :]
        else:
            new, lps = generated, seq.log_probs
        seq.num_emitted = len(generated)
        output = new if request.output_config.exclude_input_from_output else (
            seq.token_ids[: seq.num_prompt_tokens] + new
        )
        want_lp = request.output_config.return_log_probs
        result = Result(
            is_final=entry.done == len(entry.seqs),
            output_token_ids=[output],
            finish_reasons=[seq.finish_reason],
            sequence_index=seq.sequence_index,
            is_sequence_final=final,
            cum_log_probs=[float(np.sum(seq.log_probs))] if want_lp else None,
            log_probs=[lps] if want_lp else None,
        )
        if result.is_final:
            del self._entries[seq.request_id]
        return Response(seq.request_id, result=result, client_id=request.client_id)

    def _cancel(self, request_id: int) -> list[Response]:
        entry = self._entries.get(request_id)
        if entry is None:
            return []  # unknown or already finished: nothing to do
        responses = []
        for seq in entry.seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.CANCELLED)
                response = self._respond(seq)
                if response is not None:
                    responses.append(response)
        return responses

    def _fail_running(self, message: str) -> list[Response]:
        responses = []
        for request_id, entry in list(self._entries.items()):
            if not any(s.num_pending or s.state in (RequestState.CONTEXT, RequestState.GENERATION)
                       for s in entry.seqs):
                continue
            for seq in entry.seqs:
                if not seq.is_finished:
                    self.scheduler.remove(seq)
                    self._finish(seq, FinishReason.CANCELLED)
            del self._entries[request_id]
            responses.append(Response(request_id, error_msg=message, client_id=entry.request.client_id))
        return responses

    # -- stats ---------------------------------------------------------------------------

    def _record_iteration(self, batch: ScheduledBatch, num_ctx: int, t0: float) -> None:
        self._iter += 1
        stats = IterationStats(
            timestamp=time.time(),
            iter=self._iter,
            iter_latency_ms=(time.perf_counter() - t0) * 1e3,
            num_active_requests=len(self.scheduler.running),
            num_queued_requests=len(self.scheduler.waiting),
            num_context_requests=num_ctx,
            num_generation_requests=len(batch) - num_ctx,
            num_scheduled_tokens=sum(batch.num_new_tokens),
            max_num_blocks=self.blocks.num_blocks,
            free_num_blocks=self.blocks.num_free,
            used_num_blocks=self.blocks.num_blocks - self.blocks.num_free,
            reused_blocks=self.blocks.reused_blocks,
        )
        with self._lock:
            self._iteration_stats.append(stats)

    def _record_request(self, seq: Sequence) -> None:
        start = seq.arrival_time
        stats = RequestStats(
            request_id=seq.request_id,
            state=seq.state,
            prompt_tokens=seq.num_prompt_tokens,
            context_prefill_position=min(seq.num_computed, seq.num_prompt_tokens),
            num_generated_tokens=seq.num_generated,
            queue_time_ms=None if seq.first_scheduled_time is None else (seq.first_scheduled_time - start) * 1e3,
            time_to_first_token_ms=None if seq.first_token_time is None else (seq.first_token_time - start) * 1e3,
            allocated_blocks=len(seq.blocks.block_ids),
            reused_blocks=seq.num_cached_prompt // self.blocks.block_size,
        )
        with self._lock:
            self._request_stats.append(stats)

