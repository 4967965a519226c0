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
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, overload

import numpy as np

from worker.backends.base import Backend, ForwardBatch, SampleOutput, SamplingBatch, StepHandle
from worker.backends.numpy_sampler import sample as sample_on_host
from worker.executor.beam_search import BeamSearch
from worker.executor.block_manager import BlockManager, BlockTable
from worker.executor.inputs import build_forward_batch, build_sampling_batch
from worker.executor.logits_processors import apply_processors, load_processors
from worker.executor.penalties import needs_known_tokens
from worker.executor.scheduler import ScheduledBatch, Scheduler
from worker.executor.sequence import Family, Sequence
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
    """A request in flight: its sequences (one per returned sequence in sampling;
    the live beams in beam search)."""

    request_id: int
    request: Request
    seqs: list[Sequence]
    beam: BeamSearch | None = None
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
    errors: dict[int, str] = field(default_factory=dict)  # request id -> its logits post-processor's failure


@dataclass(slots=True)
class _Ready:
    output: SampleOutput | None

    def result(self) -> SampleOutput | None:
        return self.output


def _needs_known_tokens(batch: ScheduledBatch) -> bool:
    """Multi-token bad words, no-repeat n-grams, penalties, top-p reset ids and
    grammars look at the latest token before sampling: a batch with such a
    sequence waits for the step in flight instead of overlapping it."""
    return any(seq.num_pending and needs_known_tokens(seq) for seq in batch.seqs)


def _samples(seq: Sequence, n: int) -> bool:
    return seq.num_computed + n == seq.num_tokens


def _wants_host_logits(seq: Sequence) -> bool:
    """Post-processors and generation logits need the logits on the host."""
    request = seq.request
    return request.logits_post_processor_name is not None or request.output_config.return_generation_logits


def _context_rows(seq: Sequence, n: int) -> tuple[int, int] | None:
    """(first position, count) of this chunk's prompt tokens whose context logits
    are still to collect, if the request asked for them."""
    if not seq.request.output_config.return_context_logits:
        return None
    lo = max(seq.num_computed, len(seq.context_logits))
    hi = min(seq.num_computed + n, seq.num_prompt_tokens)
    return (lo, hi - lo) if hi > lo else None


def _on_host(batch: ScheduledBatch) -> bool:
    """Steps whose logits come to the host: post-processors, logits outputs."""
    return any(_context_rows(seq, n) is not None or (_samples(seq, n) and _wants_host_logits(seq))
               for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True))


def _has_beam_step(batch: ScheduledBatch) -> bool:
    """Beams pick their next tokens on the host from every beam's candidates,
    before the next step can be scheduled."""
    return any(_samples(seq, n) and seq.family is not None and seq.family.is_beam
               for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True))


class Executor:
    def __init__(
        self,
        model: str | Path,
        config: ExecutorConfig | None = None,
        *,
        backend: Backend | None = None,
        tokenizer: Any = None,
        on_iteration: Callable[[], None] | None = None,
    ) -> None:
        """Load `model` (checkpoint dir, .gguf file or the default model's name)
        onto the backend `config.backend` picks; tests and transport benchmarks
        may pass a ready `backend` (and its `tokenizer`) instead.

        `on_iteration` is called from the loop thread at every turn of the loop,
        and at least once a second while idle: proof that the loop is alive (the
        worker pings systemd's watchdog from it). It must be quick and not raise."""
        self._on_iteration = on_iteration
        self.config = config or ExecutorConfig()
        if backend is None:
            from worker.backends.device import create_backend
            from worker.models.loader import load_model

            path = Path(model)
            if not path.exists():  # a model name, such as the default model's
                from worker.models.default_model import resolve_model

                path = resolve_model(str(model))
            loaded = load_model(path)
            cfg = self.config
            backend = create_backend(loaded, cfg.backend, cfg.device, cfg.dtype,
                                     max_num_tokens=cfg.max_num_tokens, max_batch_size=cfg.max_batch_size)
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
        self.processors: dict[str, Any] = dict(self.config.logits_post_processor_map or {})
        for name, fn in load_processors(self.config.logits_post_processors).items():
            if name in self.processors:
                raise ValueError(f"logits post-processor {name!r} is configured twice")
            self.processors[name] = fn
        self._guided: Any = None  # GuidedDecoder, made on the first guided request
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
                ready = self._responses if wanted is None else [r for r in self._responses if r.request_id in wanted]
                if ready or self._shutdown:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._lock.wait(remaining)
            if ready and wanted is None:
                self._responses = []  # all taken (the worker's engine, every step)
            elif ready:
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
        validate_request(request, self.model_config, self.config, self.max_seq_len, self.processors)
        cfg = request.sampling_config
        beam = cfg.beam_width > 1
        width = cfg.beam_width if beam else request.num_return_sequences
        kv = self.config.kv_cache_config
        need = width * -(-(len(request.input_token_ids) + request.max_tokens) // kv.tokens_per_block)
        total = self._num_kv_blocks()
        if need > total:
            raise RequestError(
                f"request needs {need} KV cache blocks for prompt + max_tokens"
                f"{f' x {width} sequences' if width > 1 else ''}, but the cache holds {total}"
            )
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
        bias = None if request.embedding_bias is None else np.asarray(request.embedding_bias, dtype=np.float32)
        grammar = None
        if request.guided_decoding_params is not None:
            grammar = self._guided_decoder().compile(request.guided_decoding_params)
        family = Family(width, is_beam=beam)
        seqs = []
        for i in range(1 if beam else request.num_return_sequences):
            seq = Sequence(
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
                family=family,
                embedding_bias=bias,
            )
            if grammar is not None:
                seq.matcher = self._guided.matcher(grammar, end_id)
            seqs.append(seq)
        family.members.append(seqs[0])
        search = None
        if beam:
            search = BeamSearch(
                width=width,
                max_tokens=request.max_tokens,
                length_penalty=0.0 if cfg.length_penalty is None else cfg.length_penalty,
                early_stopping=1 if cfg.early_stopping is None else cfg.early_stopping,
                diversity_rate=cfg.beam_search_diversity_rate or 0.0,
            )
        return _Entry(request_id, request, seqs, search)

    def _guided_decoder(self) -> Any:
        if self._guided is None:
            from worker.executor.guided import GuidedDecoder

            self._guided = GuidedDecoder(self.tokenizer, self.model_config.vocab_size,
                                         list(self.model_config.eos_token_ids))
        return self._guided

    # -- the loop ----------------------------------------------------------------------

    def _loop(self) -> None:
        inflight: _InFlight | None = None
        idle_wake_s = None if self._on_iteration is None else 1.0
        while True:
            if self._on_iteration is not None:
                self._on_iteration()
            with self._lock:
                while not (self._shutdown or self._incoming or self._cancels or self.scheduler.has_work or inflight):
                    if not self._lock.wait(idle_wake_s):
                        break  # idle: one empty turn, so that on_iteration is called
                if self._shutdown:
                    return
                incoming = list(self._incoming)
                self._incoming.clear()
                cancels = self._cancels
                self._cancels = set()
            for entry in incoming:
                self._entries[entry.request_id] = entry
                # The other sequences fork this one once it has computed the prompt.
                self.scheduler.add(entry.seqs[0])
            responses = [r for rid in cancels for r in self._cancel(rid)]
            try:
                # Step N+1 is scheduled and launched before step N's tokens are
                # read back, so the device never waits for this thread.
                batch = self.scheduler.schedule()
                launched = None
                if batch:
                    host = _on_host(batch)
                    sync = host or _has_beam_step(batch)
                    if inflight is not None and (host or _needs_known_tokens(batch)):
                        responses += self._complete(inflight)
                        inflight = None
                        batch.drop_finished()  # a token just read back may have ended one
                if batch:
                    launched = self._launch(batch, host=host)
                    if sync or not self._overlap:  # steps complete in order
                        if inflight is not None:
                            responses += self._complete(inflight)
                            inflight = None
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

    def _launch(self, batch: ScheduledBatch, host: bool = False) -> _InFlight:
        """Launch one step. `host`: bring the logits to the host (post-processors,
        logits outputs) and sample there; such a step is completed at once."""
        t0 = time.perf_counter()
        num_context = sum(1 for seq in batch.seqs if seq.in_prefill)
        samplers: list[Sequence] = []
        rows: list[int] = []
        extra: list[tuple[Sequence, int, int]] = []  # (seq, first position, count) of context logits
        offset = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if host and (ctx := _context_rows(seq, n)) is not None:
                extra.append((seq, offset + ctx[0] - seq.num_computed, ctx[1]))
            offset += n
            if not _samples(seq, n):
                rows.append(0)
                continue
            group = [seq, *self._fork_siblings(seq, n)]
            samplers += group
            rows.append(len(group))
        forward = build_forward_batch(batch, self.blocks.block_size, rows,
                                      [(a, c) for _, a, c in extra])
        sampling = build_sampling_batch(samplers) if samplers else None
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed += n
        # Each sampler gets a placeholder for the token this step will sample;
        # beams get theirs from the beam step, once every beam has its candidates.
        positions = []
        for row, seq in enumerate(samplers):
            if seq.family is not None and seq.family.is_beam:
                positions.append(-1)
                continue
            seq.token_ids.append(-(row + 1))
            seq.num_pending += 1
            positions.append(len(seq.token_ids) - 1)
        if batch.copies:
            src, dst = zip(*batch.copies, strict=True)
            self.backend.copy_blocks(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64))
        errors: dict[int, str] = {}
        if host:
            handle: StepHandle = self._host_step(forward, sampling, samplers, extra, errors)
        else:
            handle = self._launch_step(forward, sampling)
        return _InFlight(batch, samplers, positions, handle, num_context, t0, errors)

    def _fork_siblings(self, leader: Sequence, n: int) -> list[Sequence]:
        """When a sampling request's prompt is computed, its other returned
        sequences fork the leader's blocks and sample from the same logits."""
        family = leader.family
        if family is None or family.is_beam or family.forked or family.width == 1:
            return []
        family.forked = True
        entry = self._entries[leader.request_id]
        siblings = [s for s in entry.seqs[1:] if not s.is_finished]
        for sib in siblings:
            sib.blocks = self.blocks.fork(leader.blocks)
            sib.num_computed = leader.num_computed + n
            sib.first_scheduled_time = leader.first_scheduled_time
            sib.num_cached_prompt = leader.num_cached_prompt
            self.scheduler.add_running(sib)
            family.members.append(sib)
        return siblings

    def _host_step(self, forward: ForwardBatch, sampling: SamplingBatch | None, samplers: list[Sequence],
                   extra: list[tuple[Sequence, int, int]], errors: dict[int, str]) -> _Ready:
        logits = self.backend.logits_to_host(self.backend.forward(forward))
        num_rows = len(samplers)
        for seq, a, count in extra:
            seq.context_logits.extend(logits[num_rows + a : num_rows + a + count].copy())
        if sampling is None:
            self._last_sampled = None
            return _Ready(None)
        rows = np.array(logits[:num_rows], dtype=np.float32)
        for row, seq in enumerate(samplers):
            if seq.request.output_config.return_generation_logits:
                seq.generation_logits.append(rows[row].copy())
        picked = [r for r, seq in enumerate(samplers) if seq.request.logits_post_processor_name is not None]
        if picked:
            new, failed = apply_processors(self.processors, [
                (samplers[r].request_id, samplers[r].request.logits_post_processor_name or "", rows[r : r + 1],
                 [samplers[r].token_ids[: samplers[r].num_known]], samplers[r].request.client_id)
                for r in picked
            ])
            for k, r in enumerate(picked):
                rows[r] = new[k][0]
            for k, message in failed.items():
                errors[samplers[picked[k]].request_id] = message
        out = sample_on_host(rows, sampling)
        self._last_sampled = out.token_ids
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

    def _complete(self, step: _InFlight) -> list[Response]:
        """Read back a step's tokens, put them in place, answer and free what finished."""
        out = step.handle.result()
        responses: list[Response] = []
        for request_id, message in step.errors.items():
            responses += self._fail_request(request_id, message)
        beams: dict[int, _Entry] = {}
        if out is not None:
            now = time.monotonic()
            # Python numbers once per step, not a numpy scalar per row.
            tokens, log_probs = out.token_ids.tolist(), out.log_probs.tolist()
            for row, (seq, pos) in enumerate(zip(step.samplers, step.positions, strict=True)):
                if seq.is_finished:
                    continue  # cancelled, or finished a step earlier: a token nobody wants
                if seq.first_token_time is None:
                    seq.first_token_time = now
                if pos < 0:
                    assert out.top_tokens is not None and out.top_log_probs is not None
                    seq.candidates = (out.top_tokens[row], out.top_log_probs[row])
                    beams[seq.request_id] = self._entries[seq.request_id]
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
                reason = self._finish_reason(seq, pos + 1)
                if reason is not FinishReason.NOT_FINISHED:
                    self._finish(seq, reason)
                response = self._respond(seq)
                if response is not None:
                    responses.append(response)
        for entry in beams.values():
            if all(m.candidates is not None for m in entry.seqs):
                responses += self._beam_step(entry)
        for seq in step.batch.seqs:
            if not seq.is_finished:
                known = len(seq.token_ids) - seq.num_pending
                self.blocks.register_full_blocks(seq.blocks, seq.token_ids, min(seq.num_computed, known))
        self._record_iteration(step.batch, step.num_context, step.t0)
        return responses

    # -- beam search -----------------------------------------------------------------

    def _beam_ends(self, seq: Sequence, token: int) -> FinishReason:
        if token == seq.end_id:
            return FinishReason.END_ID
        generated = [*seq.generated, token]
        for word in seq.stop_words:
            if len(word) <= len(generated) and generated[len(generated) - len(word) :] == word:
                return FinishReason.STOP_WORDS
        return FinishReason.NOT_FINISHED

    def _beam_step(self, entry: _Entry) -> list[Response]:
        """Every beam has its candidates: pick the next beams, and give each its
        parent's tokens and KV blocks (shared, copied on write)."""
        search = entry.beam
        assert search is not None
        members = entry.seqs
        k = 2 * search.width
        tokens = np.stack([m.candidates[0][:k] for m in members])  # type: ignore[index]
        log_probs = np.stack([m.candidates[1][:k] for m in members])  # type: ignore[index]
        for m in members:
            m.candidates = None
        continuations = search.step(tokens, log_probs, [m.generated for m in members],
                                    [m.log_probs for m in members], lambda b, t: self._beam_ends(members[b], t))
        if search.done:
            return self._end_beams(entry, FinishReason.NOT_FINISHED)
        running = set(map(id, self.scheduler.running))
        parents = [(m.token_ids, m.log_probs, m.num_computed, id(m) in running and m.num_computed == m.num_tokens)
                   for m in members]
        tables = [self.blocks.fork(members[c.parent].blocks) if parents[c.parent][3] else BlockTable()
                  for c in continuations]
        for m in members:
            self.blocks.free(m.blocks)
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
                    self.scheduler.add_running(slot)
                else:
                    self.scheduler.add(slot)
            elif id(slot) in running and not has_kv:
                self.scheduler.requeue(slot)
            elif id(slot) not in running and slot.blocks.block_ids:
                self.blocks.free(slot.blocks)  # it waits: it will recompute
                slot.num_computed = 0
        if entry.request.streaming:  # the best running beams so far (members are in score order)
            best = members[: entry.request.num_return_sequences]
            return [self._beam_response(entry, [(m.generated, m.log_probs, FinishReason.NOT_FINISHED)
                                                for m in best], final=False)]
        return []

    def _end_beams(self, entry: _Entry, reason: FinishReason) -> list[Response]:
        """Finish a beam search: free every beam, answer with the best hypotheses
        (cancelled: the finished ones, else the running beams)."""
        search = entry.beam
        assert search is not None
        hyps: list[tuple[list[int], list[float], FinishReason]] = [
            (h.tokens, h.log_probs, h.reason) for h in search.finished]
        if reason is not FinishReason.NOT_FINISHED:  # cut short: the best it has, marked so
            found = hyps or [(m.generated, m.log_probs, reason) for m in entry.seqs]
            hyps = [(tokens, lps, reason) for tokens, lps, _ in found]
        self._record_request(entry.seqs[0])
        for m in entry.seqs:
            m.finish_reason = reason if reason is not FinishReason.NOT_FINISHED else FinishReason.LENGTH
            m.num_pending = 0
            self.scheduler.remove(m)
            m.state = RequestState.FINISHED
        del self._entries[entry.request_id]
        return [self._beam_response(entry, hyps[: entry.request.num_return_sequences], final=True)]

    def _beam_response(self, entry: _Entry, beams: list[tuple[list[int], list[float], FinishReason]],
                       final: bool) -> Response:
        request = entry.request
        prompt = [] if request.output_config.exclude_input_from_output else list(request.input_token_ids)
        want_lp = request.output_config.return_log_probs
        result = Result(
            is_final=final,
            output_token_ids=[prompt + tokens for tokens, _, _ in beams],
            finish_reasons=[reason for _, _, reason in beams],
            sequence_index=0,
            is_sequence_final=final,
            cum_log_probs=[float(np.sum(lps)) for _, lps, _ in beams] if want_lp else None,
            log_probs=[list(lps) for _, lps, _ in beams] if want_lp else None,
        )
        return Response(entry.request_id, result=result, client_id=request.client_id)

    def _finish_reason(self, seq: Sequence, length: int) -> FinishReason:
        """Why the sequence ends at token_ids[:length], if it does."""
        tokens = seq.token_ids
        if tokens[length - 1] == seq.end_id:
            return FinishReason.END_ID
        if seq.matcher is not None and (not seq.matcher.accept(tokens[length - 1]) or seq.matcher.is_terminated):
            # The grammar is complete (it accepted a stop token) or, with no end
            # token to stop on, can take nothing more.
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
        # Sliced straight from token_ids: copying all generated tokens first would make
        # every streamed step cost as much as the stream is long.
        num_generated = seq.num_known - seq.num_prompt_tokens
        first = 0 if not request.streaming or request.return_all_generated_tokens else seq.num_emitted
        new, lps = seq.token_ids[seq.num_prompt_tokens + first : seq.num_known], seq.log_probs[first:]
        seq.num_emitted = num_generated
        out_cfg = request.output_config
        output = new if out_cfg.exclude_input_from_output else seq.token_ids[: seq.num_prompt_tokens] + new
        want_lp = out_cfg.return_log_probs
        result = Result(
            is_final=entry.done == len(entry.seqs),
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
        )
        if result.is_final:
            del self._entries[seq.request_id]
        return Response(seq.request_id, result=result, client_id=request.client_id)

    def _cancel(self, request_id: int) -> list[Response]:
        entry = self._entries.get(request_id)
        if entry is None:
            return []  # unknown or already finished: nothing to do
        if entry.beam is not None:
            return self._end_beams(entry, FinishReason.CANCELLED)
        responses = []
        for seq in entry.seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.CANCELLED)
                response = self._respond(seq)
                if response is not None:
                    responses.append(response)
        return responses

    def _fail_request(self, request_id: int, message: str) -> list[Response]:
        """End one request with an error (its sequences are freed)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return []
        for seq in entry.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                self._finish(seq, FinishReason.CANCELLED)
        return [Response(request_id, error_msg=message, client_id=entry.request.client_id)]

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

