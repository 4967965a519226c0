"""The engine core: continuous batching one iteration at a time, with no threads,
no locks and no I/O.

`step()` is the whole iteration: schedule the next batch, launch it on the
backend, and complete the step the previous call launched while this one runs on
the device (overlap scheduling) — read its sampled tokens back, put them in
place, build the outputs and free what finished. Steps whose tokens the next
schedule depends on (logits on the host, beam search, a backend that computes as
it is called) complete in the same call. Whoever drives the core does the I/O
around `step()`: the in-process `Executor` (a thread and queues) or the worker's
engine process (pipes to the worker).

Speculative decoding (speculative.py) adds one stage before scheduling: the
sequences that speculate get draft tokens (seq.draft) from their source, their
generation step verifies them, and that step completes in the call that
launched it, since how many tokens it keeps decides the next step.

LoRA adapters (adapter_cache.py) are read from disk by `register_lora`, which the
driver calls between steps (or `load_lora` on any thread, then `add_lora`); an adapter
dropped from host memory is read again on the adapter cache's loader thread, its
requests waiting meanwhile, so `step()` itself never waits on a file.

Request ids are the caller's: the core answers under the id a request came with.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from worker.backends.base import (
    AsyncBackend,
    Backend,
    ForwardBatch,
    LoraBackend,
    SampleOutput,
    SamplingBatch,
    StepHandle,
)
from worker.backends.numpy_sampler import process_logits
from worker.backends.numpy_sampler import sample as sample_on_host
from worker.executor import beam_search, prompt_log_probs
from worker.executor.adapter_cache import AdapterCache
from worker.executor.beam_search import BeamSearch
from worker.executor.block_manager import BlockManager
from worker.executor.draft_model import DraftModel
from worker.executor.inputs import build_forward_batch, build_sampling_batch, with_peft_inputs
from worker.executor.log_probs import normalized_log_probs
from worker.executor.logits_processors import apply_processors, load_processors
from worker.executor.penalties import needs_known_tokens
from worker.executor.scheduler import ScheduledBatch, Scheduler
from worker.executor.sequence import Family, Sequence
from worker.executor.speculative import (
    SpecState,
    external_drafts,
    max_drafts,
    num_accepted,
    off_reason,
    off_reason_for_tokens,
    prompt_lookup,
)
from worker.executor.speculative import validate as validate_speculative
from worker.executor.types import (
    DraftSource,
    ExecutorConfig,
    FinishReason,
    IterationStats,
    PeftCacheConfig,
    Request,
    RequestState,
    RequestStats,
    Response,
    Result,
)
from worker.executor.validation import RequestError, normalize_word_list, validate_request
from worker.models.lora import LoraAdapter

log = logging.getLogger(__name__)

_VERIFIED = -2  # _InFlight.positions entry of a verification row (see _InFlight.verify)


@dataclass(slots=True)
class StepOutput:
    """What the core produced since the last `step()`.

    Plain streamed steps (not final, sequence 0, tokens alone, no client id) come in
    columns: request `ids[i]` produced `counts[i]` tokens, in order in `token_ids`;
    these map one to one onto the wire's `protocol.StreamedTokens`. Every other
    response comes whole in `responses` (errors, finals, beams, log probs, logits),
    after its request's columns. `request_stats` holds the stats of the requests
    that ended; `iteration_stats` one record per completed step."""

    ids: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    responses: list[Response] = field(default_factory=list)
    request_stats: list[RequestStats] = field(default_factory=list)
    iteration_stats: list[IterationStats] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.ids or self.responses or self.request_stats or self.iteration_stats)

    def stream(self, request_id: int, tokens: list[int]) -> None:
        self.ids.append(request_id)
        self.counts.append(len(tokens))
        self.token_ids += tokens

    def all_responses(self) -> list[Response]:
        """Every response, the columns expanded into Responses first (the order they happened in)."""
        out = []
        start = 0
        for request_id, n in zip(self.ids, self.counts, strict=True):
            tokens = self.token_ids[start : start + n]
            start += n
            out.append(Response(request_id, Result(False, [tokens], [FinishReason.NOT_FINISHED])))
        return out + self.responses


@dataclass(eq=False, slots=True)
class _Entry:
    """A request in flight: its sequences (one per returned sequence in sampling;
    the live beams in beam search)."""

    request_id: int
    request: Request
    seqs: list[Sequence]
    beam: BeamSearch | None = None
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
    # The next schedule needs this step's tokens: it completes in the call that launched it.
    blocking: bool
    errors: dict[int, str] = field(default_factory=dict)  # request id -> its logits post-processor's failure
    # Speculative decoding: (sequence, its first sampler row, its drafts); rows
    # first .. first + len(drafts) are its verification rows.
    verify: list[tuple[Sequence, int, list[int]]] = field(default_factory=list)


@dataclass(slots=True)
class _Ready:
    output: SampleOutput | None

    def result(self) -> SampleOutput | None:
        return self.output


def _samples(seq: Sequence, n: int) -> bool:
    return seq.num_computed + n == seq.num_tokens


def _wants_host_logits(seq: Sequence, normalize_log_probs: bool) -> bool:
    """Post-processors, generation logits and normalized log probs need the logits on the host."""
    request = seq.request
    return (request.logits_post_processor_name is not None or request.output_config.return_generation_logits
            or (normalize_log_probs and _normalizes(seq)))


def _normalizes(seq: Sequence) -> bool:
    """Whether seq's log probs are renormalized (ExecutorConfig.normalize_log_probs); beams keep theirs."""
    return seq.request.output_config.return_log_probs and not (seq.family is not None and seq.family.is_beam)


def _context_rows(seq: Sequence, n: int) -> tuple[int, int] | None:
    """(first position, count) of this chunk's prompt tokens whose context logits
    are still to collect, if the request asked for them."""
    if not prompt_log_probs.wants_rows(seq):
        return None
    lo = max(seq.num_computed, prompt_log_probs.rows_collected(seq))
    hi = min(seq.num_computed + n, seq.num_prompt_tokens)
    return (lo, hi - lo) if hi > lo else None


def _on_host(batch: ScheduledBatch, normalize_log_probs: bool) -> bool:
    """Steps whose logits come to the host: post-processors, logits outputs, normalized log probs."""
    return any(_context_rows(seq, n) is not None or (_samples(seq, n) and _wants_host_logits(seq, normalize_log_probs))
               for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True))


def _needs_known_tokens(batch: ScheduledBatch) -> bool:
    """Multi-token bad words, no-repeat n-grams, penalties, top-p reset ids and
    grammars look at the latest token before sampling: a batch with such a
    sequence waits for the step in flight instead of overlapping it."""
    return any(seq.num_pending and needs_known_tokens(seq) for seq in batch.seqs)


def _has_beam_step(batch: ScheduledBatch) -> bool:
    """Beams pick their next tokens on the host from every beam's candidates,
    before the next step can be scheduled."""
    return any(_samples(seq, n) and seq.family is not None and seq.family.is_beam
               for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True))


class EngineCore:
    def __init__(self, backend: Backend, config: ExecutorConfig | None = None, *, tokenizer: Any = None,
                 chat_template: str | None = None, draft: DraftModel | None = None) -> None:
        """A core over a ready backend (`from_model` loads one). `tokenizer` is needed
        only by guided decoding; `chat_template` is carried for the APIs above;
        `draft`: the draft model of speculative decoding, if any (it gets as many KV
        blocks as the target)."""
        self.config = config or ExecutorConfig()
        self.backend = backend
        self.draft = draft
        if draft is not None and draft.backend.config.vocab_size != backend.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.backend.config.vocab_size} tokens) is not "
                             f"the target's ({backend.config.vocab_size}): they must share the tokenizer")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.model_config = backend.config
        self.max_seq_len = self.model_config.max_position_embeddings

        kv = self.config.kv_cache_config
        # LoRA slots take device memory before the KV cache is sized.
        self.adapters = self._adapter_cache() if self.config.lora_enabled else None
        num_blocks = self._num_kv_blocks()
        self.backend.allocate_kv_cache(num_blocks, kv.tokens_per_block)
        if draft is not None:
            draft.allocate(num_blocks, kv.tokens_per_block)
        self.blocks = BlockManager(num_blocks, kv.tokens_per_block, kv.enable_block_reuse)
        self.scheduler = Scheduler(self.config, self.blocks)
        self.scheduler.adapter_ready = self._adapter_ready
        self._adapter_errors: dict[int, str] = {}  # request id -> why its adapter could not be loaded
        asynchronous = isinstance(backend, AsyncBackend)
        self._launch_step = backend.launch if isinstance(backend, AsyncBackend) else self._launch_sync
        overlap = self.config.overlap_scheduling
        self._overlap = asynchronous if overlap is None else overlap
        self._last_sampled: np.ndarray | None = None
        self.processors: dict[str, Any] = dict(self.config.logits_post_processor_map or {})
        for name, fn in load_processors(self.config.logits_post_processors).items():
            if name in self.processors:
                raise ValueError(f"logits post-processor {name!r} is configured twice")
            self.processors[name] = fn
        self._guided: Any = None  # GuidedDecoder, made on the first guided request
        log.info("engine core: backend=%s kv_blocks=%d x %d tokens (max_batch_size=%d sequences of up to %d "
                 "tokens each)", backend.name, num_blocks, kv.tokens_per_block, self.config.max_batch_size,
                 num_blocks * kv.tokens_per_block // self.config.max_batch_size)

        self._entries: dict[int, _Entry] = {}
        self._inflight: _InFlight | None = None
        self._out = StepOutput()
        self._iter = 0
        self._num_drafted = 0  # draft tokens verified since the last iteration record
        self._num_accepted = 0
        # The configured adapters are read here, as the model is by from_model: a core is
        # ready to serve them once built.
        for name, path in self.config.lora_adapters.items():
            self.register_lora(name, path)

    @classmethod
    def from_model(cls, path: str | Path, config: ExecutorConfig | None = None) -> EngineCore:
        """Load a checkpoint directory or .gguf file onto the backend `config.backend` picks."""
        from worker.backends.device import create_backend
        from worker.models.loader import load_model

        cfg = config or ExecutorConfig()
        loaded = load_model(path, quantization=cfg.quantization)
        backend = create_backend(loaded, cfg.backend, cfg.device, cfg.dtype,
                                 max_num_tokens=cfg.max_num_tokens, max_batch_size=cfg.max_batch_size,
                                 parallel=cfg.parallel_config, kv_cache_dtype=cfg.kv_cache_config.dtype)
        draft = None
        if cfg.draft_model is not None:
            draft = DraftModel.load(cfg.draft_model, cfg.backend, cfg.device, cfg.dtype,
                                    cfg.max_num_tokens, cfg.max_batch_size)
        return cls(backend, cfg, tokenizer=loaded.tokenizer, chat_template=loaded.chat_template, draft=draft)

    # -- LoRA adapters (called by the driver between steps) -------------------------------

    def register_lora(self, name: str, path: str) -> None:
        """Read, check and register a PEFT adapter under `name` (replacing one of that
        name for new requests). CheckpointError names what is wrong with it."""
        self.add_lora(name, path, self._lora_cache().load(path))

    def add_lora(self, name: str, path: str, adapter: LoraAdapter) -> None:
        """Register an adapter already read from `path` (a driver reads it off its engine thread)."""
        self._lora_cache().add(name, path, adapter)

    def load_lora(self, path: str) -> LoraAdapter:
        """Read and check an adapter against the model; no state changes (safe from any thread)."""
        return self._lora_cache().load(path)

    def unregister_lora(self, name: str) -> None:
        """New requests can no longer name it; queued ones fail, running ones finish under it."""
        key = self._lora_cache().remove(name)
        for seq in list(self.scheduler.waiting):
            if seq.adapter == key and seq.request_id in self._entries:
                self._fail_request(seq.request_id, f"LoRA adapter {name!r} was unloaded")

    def lora_names(self) -> list[str]:
        return [] if self.adapters is None else self.adapters.names()

    # -- what the driver calls ----------------------------------------------------------

    def add_requests(self, requests: Iterable[tuple[int, Request]]) -> None:
        """Start requests under the caller's ids; an invalid one (or an id already in
        flight) ends with an error response in the next step's output."""
        for request_id, request in requests:
            try:
                if request_id in self._entries:
                    raise RequestError(f"request id {request_id} is already in flight")
                entry = self._make_entry(request_id, request)
            except RequestError as e:
                self._out.responses.append(Response(request_id, error_msg=str(e), client_id=request.client_id))
                continue
            except Exception as e:  # preparing one request (a grammar, say) must never end the core
                log.exception("request %s: could not be prepared", request_id)
                message = f"worker failed to start the request: {type(e).__name__}: {e}"
                self._out.responses.append(Response(request_id, error_msg=message, client_id=request.client_id))
                continue
            self._entries[request_id] = entry
            # The other sequences fork this one once it has computed the prompt.
            self.scheduler.add(entry.seqs[0])

    def abort(self, request_id: int) -> None:
        """Cancel a request: it ends with a CANCELLED final response (unknown or
        finished ids are ignored)."""
        entry = self._entries.get(request_id)
        if entry is None:
            return
        if entry.beam is not None:
            self._end_beams(entry, FinishReason.CANCELLED)
            return
        for seq in entry.seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.CANCELLED)
                self._respond(seq)

    @property
    def has_work(self) -> bool:
        """Whether `step()` has anything to do: requests to run, a step in flight, or output to hand over."""
        return self.scheduler.has_work or self._inflight is not None or bool(self._out)

    def load(self) -> tuple[int, int, int]:
        """(queued, active, free KV blocks)."""
        return len(self.scheduler.waiting), len(self.scheduler.running), self.blocks.num_free

    def step(self) -> StepOutput:
        """One iteration: schedule, launch, complete the previous launch. A backend
        failure ends the requests that were running, not the core."""
        try:
            self._propose()
            batch = self.scheduler.schedule()
            for request_id, message in self._adapter_errors.items():
                self._fail_request(request_id, message)
            self._adapter_errors.clear()
            if batch and self._inflight is not None and (_on_host(batch, self.config.normalize_log_probs)
                                                       or _needs_known_tokens(batch)):
                self._complete_inflight()  # this batch samples from the tokens in flight
                batch.drop_finished()  # a token just read back may have ended one
            launched = self._launch(batch) if batch else None
            self._complete_inflight()  # step N-1, read back while step N runs on the device
            self._inflight = launched
            if launched is not None and launched.blocking:
                self._complete_inflight()
            if not batch and self._inflight is None and self.scheduler.has_work:
                time.sleep(0.001)  # nothing fits yet: wait for cancels or new room
        except Exception as e:
            log.exception("engine step failed")
            self._inflight = None
            self._fail_running(f"internal error in the executor step: {e}")
        out, self._out = self._out, StepOutput()
        return out

    # -- request intake -------------------------------------------------------------------

    def _num_kv_blocks(self) -> int:
        kv = self.config.kv_cache_config
        if kv.max_tokens is not None:
            tokens = kv.max_tokens
        else:
            per_token = self.backend.kv_bytes_per_token()
            if self.draft is not None:  # the draft model holds as many blocks as the target
                per_token += self.draft.backend.kv_bytes_per_token()
            free = self.backend.free_memory_bytes()
            tokens = int(kv.free_memory_fraction * free) // per_token
            # More KV than every batch slot at full context is never used.
            tokens = min(tokens, self.config.max_batch_size * self.max_seq_len)
            batch = self.config.max_batch_size
            if tokens < batch * kv.tokens_per_block:  # the configured batch could never run
                raise ValueError(
                    f"KV cache: {free / (1 << 30):.2f} GiB left after weights and working memory holds "
                    f"{tokens} tokens at free_memory_fraction={kv.free_memory_fraction}, less than one "
                    f"{kv.tokens_per_block}-token block for each of max_batch_size={batch} sequences: lower "
                    f"max_batch_size (to at most {tokens // kv.tokens_per_block}) or max_num_tokens (the working "
                    "memory of one step grows with both; the backend's log line says by how much)"
                )
        return max(1, tokens // kv.tokens_per_block)

    def _adapter_cache(self) -> AdapterCache:
        if not isinstance(self.backend, LoraBackend):
            raise ValueError(f"the {self.backend.name} backend does not run LoRA adapters")
        peft = self.config.peft_cache_config or PeftCacheConfig()
        cache = AdapterCache(peft, self.model_config, self.backend)
        self.backend.enable_lora(peft.max_device_adapters, peft.max_rank)
        return cache

    def _lora_cache(self) -> AdapterCache:
        if self.adapters is None:
            raise ValueError("LoRA is off on this executor: set ExecutorConfig.peft_cache_config to enable it")
        return self.adapters

    def _adapter_ready(self, seq: Sequence) -> bool:
        """Scheduler hook: put seq's adapter in a device slot if it can go there now."""
        assert self.adapters is not None and seq.adapter is not None
        busy = {s.adapter for s in self.scheduler.running if s.adapter is not None}
        try:
            return self.adapters.acquire(seq.adapter, busy) is not None
        except (ValueError, OSError) as e:  # unregistered, or its files no longer load: this request alone fails
            self._adapter_errors[seq.request_id] = str(e)
            return False

    def _peft_of(self, request: Request) -> tuple[tuple[str, int] | None, np.ndarray | None, int | None]:
        """(adapter key, prompt table, prefix-cache salt) of a request."""
        key = None
        if request.lora_config is not None:
            name = request.lora_config.name
            key = None if self.adapters is None else self.adapters.key(name)
            if key is None:
                raise RequestError(self.adapters.unknown(name) if self.adapters is not None
                                   else f"unknown LoRA adapter {name!r} (held: none; LoRA is off on this worker)")
        table = None
        if request.prompt_tuning_config is not None:
            if self.config.parallel_config.tensor_parallel_size > 1:  # the vocab-parallel lookup has no rows for it
                raise RequestError("prompt_tuning_config is not supported with tensor parallelism yet")
            table = np.ascontiguousarray(request.prompt_tuning_config.embedding_table, dtype=np.float32)
        if key is None and table is None:
            return None, None, None
        digest = None if table is None else hashlib.sha256(table.tobytes()).hexdigest() + str(table.shape)
        return key, table, hash((key, digest))

    def _make_entry(self, request_id: int, request: Request) -> _Entry:
        validate_request(request, self.model_config, self.config, self.max_seq_len, self.processors)
        adapter, prompt_table, salt = self._peft_of(request)
        cfg = request.sampling_config
        beam = cfg.beam_width > 1
        width = cfg.beam_width if beam else request.num_return_sequences
        need = width * -(-(len(request.input_token_ids) + request.max_tokens) // self.blocks.block_size)
        if need > self.blocks.num_blocks:
            raise RequestError(
                f"request needs {need} KV cache blocks for prompt + max_tokens"
                f"{f' x {width} sequences' if width > 1 else ''}, but the cache holds {self.blocks.num_blocks}"
            )
        eos = self.model_config.eos_token_ids
        end_id = request.end_id if request.end_id is not None else (eos[0] if eos else -1)
        greedy = cfg.is_greedy
        params = (
            0.0 if greedy else (1.0 if cfg.temperature is None else cfg.temperature),
            float(cfg.top_k or 0),
            cfg.top_p or 1.0,  # None or 0: off
            cfg.min_p or 0.0,
        )
        seed = cfg.seed if cfg.seed is not None else 0  # TensorRT-LLM's default: reproducible
        stop_words = normalize_word_list(request.stop_words, "stop_words")
        bad_words = normalize_word_list(request.bad_words, "bad_words")
        bias = None if request.embedding_bias is None else np.asarray(request.embedding_bias, dtype=np.float32)
        grammar = None
        if request.guided_decoding_params is not None:
            grammar = self._guided_decoder().compile(request.guided_decoding_params)
        spec_config = request.speculative_config or self.config.speculative_config
        if spec_config is not None and (problem := validate_speculative(spec_config, self.model_config.vocab_size)):
            raise RequestError(problem)
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
                adapter=adapter,
                prompt_table=prompt_table,
                cache_salt=salt,
            )
            if grammar is not None:
                seq.matcher = self._guided.matcher(grammar, end_id)
            if spec_config is not None and spec_config.num_draft_tokens > 0:
                reason = (off_reason(request, spec_config, self.draft is not None)
                          or off_reason_for_tokens(seq))
                if reason is None:
                    seq.spec = SpecState(spec_config)
                seq.speculation_off_reason = reason
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

            given = self.config.guided_decoding_config
            stop_ids = list(self.model_config.eos_token_ids)
            if given is None:
                self._guided = GuidedDecoder.from_tokenizer(self.tokenizer, self.model_config.vocab_size, stop_ids)
            else:
                self._guided = GuidedDecoder(given.encoded_vocab, given.tokenizer_str, self.model_config.vocab_size,
                                             stop_ids if given.stop_token_ids is None else given.stop_token_ids)
        return self._guided

    # -- speculative decoding -------------------------------------------------------------------

    def _propose(self) -> None:
        """Draft tokens (seq.draft) for the running sequences that speculate. Drafts
        follow the latest token, so a step in flight that samples it completes first;
        steps without speculating sequences keep overlapping."""
        if self.draft is not None:
            self.draft.retain(self.scheduler.running)
        candidates = []
        for seq in self.scheduler.running:
            if seq.spec is not None:
                seq.draft = []
                if not seq.in_prefill and not seq.is_finished:
                    candidates.append(seq)
        if not candidates:
            return
        if self._inflight is not None and any(seq.num_pending for seq in candidates):
            self._complete_inflight()
        wanted = []
        for seq in candidates:
            k = 0 if seq.is_finished else max_drafts(seq, self.max_seq_len)
            if k > 0:
                wanted.append((seq, k))
        by_model = []
        for seq, k in wanted:
            assert seq.spec is not None
            cfg = seq.spec.config
            if cfg.source is DraftSource.PROMPT_LOOKUP:
                seq.draft = prompt_lookup(seq.token_ids, seq.spec.packed_tokens(seq.token_ids), k, cfg.max_ngram,
                                          cfg.min_ngram)
            elif cfg.source is DraftSource.DRAFT_TOKENS:
                seq.draft = external_drafts(seq.spec, seq.generated, k)
            else:
                by_model.append((seq, k))
        if by_model:
            assert self.draft is not None
            for (seq, _), drafts in zip(by_model, self.draft.propose(by_model), strict=True):
                seq.draft = drafts

    def _accept(self, seq: Sequence, drafts: list[int], tokens: list[int], log_probs: list[float],
                top: tuple[np.ndarray, np.ndarray] | None) -> None:
        """Keep the verified tokens of one speculating sequence (speculative.py): the
        drafts the target sampled itself, then its own next token; roll the KV of
        the rejected drafts back; end the sequence where a token ends it."""
        assert seq.spec is not None
        accepted = num_accepted(drafts, tokens)
        seq.spec.num_drafted += len(drafts)
        seq.spec.num_accepted += accepted
        self._num_drafted += len(drafts)
        self._num_accepted += accepted
        # The KV holds the last token and every draft; only the accepted drafts' stays.
        seq.num_computed -= len(drafts) - accepted
        seq.state = RequestState.GENERATION
        top_n = seq.request.output_config.top_n_log_probs
        for j in range(accepted + 1):
            seq.token_ids.append(tokens[j])
            seq.log_probs.append(log_probs[j])
            if top_n:
                assert top is not None
                seq.top_token_ids.append(top[0][j, :top_n].tolist())
                seq.top_log_probs.append(top[1][j, :top_n].tolist())
            reason = self._finish_reason(seq, seq.num_tokens)
            if reason is not FinishReason.NOT_FINISHED:
                self._finish(seq, reason)  # tokens after this one are dropped
                break
        if not seq.is_finished:
            # Blocks wholly past the sequence held only rejected drafts' KV.
            self.blocks.truncate(seq.blocks, seq.num_tokens)
        self._respond(seq)

    # -- launch -------------------------------------------------------------------------------

    def _launch(self, batch: ScheduledBatch) -> _InFlight:
        """Launch one step. Steps that need the logits on the host (post-processors,
        logits outputs) sample there."""
        t0 = time.perf_counter()
        host = _on_host(batch, self.config.normalize_log_probs)
        num_context = sum(1 for seq in batch.seqs if seq.in_prefill)
        samplers: list[Sequence] = []
        rows: list[int] = []
        extra: list[tuple[Sequence, int, int]] = []  # (seq, first position, count) of context logits
        verify: list[tuple[Sequence, int, list[int]]] = []
        offsets: list[int] = []  # per sampler row: output positions past the sequence's next one
        offset = 0
        for seq, n, drafts in zip(batch.seqs, batch.num_new_tokens, batch.drafts, strict=True):
            if host and (ctx := _context_rows(seq, n)) is not None:
                extra.append((seq, offset + ctx[0] - seq.num_computed, ctx[1]))
            offset += n
            if drafts:  # a verification row for the last token and each draft
                verify.append((seq, len(samplers), drafts))
                samplers += [seq] * (len(drafts) + 1)
                offsets += range(len(drafts) + 1)
                rows.append(len(drafts) + 1)
                continue
            if not _samples(seq, n):
                rows.append(0)
                continue
            group = [seq, *self._fork_siblings(seq, n)]
            samplers += group
            offsets += [0] * len(group)
            rows.append(len(group))
        forward = build_forward_batch(batch, self.blocks.block_size, rows,
                                      [(a, c) for _, a, c in extra])
        if any(seq.adapter is not None or seq.prompt_table is not None for seq in batch.seqs):
            slots = [-1 if seq.adapter is None else self._lora_cache().slot(seq.adapter) for seq in batch.seqs]
            forward = with_peft_inputs(forward, batch, slots, self.model_config.vocab_size)
        sampling = build_sampling_batch(samplers, offsets if verify else None) if samplers else None
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed += n
        # Each sampler gets a placeholder for the token this step will sample;
        # beams get theirs from the beam step, once every beam has its candidates.
        positions = []
        verified = {seq for seq, _, _ in verify}
        for row, seq in enumerate(samplers):
            if seq in verified:  # its tokens are kept at completion, once the acceptance is known
                positions.append(_VERIFIED)
                continue
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
        # How many tokens a verification keeps is known only once it is read back:
        # the next schedule waits for it.
        blocking = host or _has_beam_step(batch) or not self._overlap or bool(verify)
        return _InFlight(batch, samplers, positions, handle, num_context, t0, blocking, errors, verify)

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
        # The context rows follow the sampling rows, each sequence's in the order of `extra`.
        at = len(samplers)
        for seq, _, count in extra:
            prompt_log_probs.collect(seq, logits[at : at + count])
            at += count
        num_rows = len(samplers)
        if sampling is None:
            self._last_sampled = None
            return _Ready(None)
        rows = np.array(logits[:num_rows], dtype=np.float32)
        for row, seq in enumerate(samplers):
            if seq.request.output_config.return_generation_logits:
                seq.generation_logits.append(rows[row].copy())
        # A post-processor sees one request at a time: a beam search's beams together
        # ([beam_width, vocab] and every beam's tokens), any other sequence alone.
        groups: dict[object, list[int]] = {}
        for r, seq in enumerate(samplers):
            if seq.request.logits_post_processor_name is not None:
                beam = seq.family is not None and seq.family.is_beam
                groups.setdefault(seq.request_id if beam else (seq.request_id, r), []).append(r)
        picked = list(groups.values())
        if picked:
            new, failed = apply_processors(self.processors, [
                (samplers[g[0]].request_id, samplers[g[0]].request.logits_post_processor_name or "", rows[g],
                 [samplers[r].token_ids[: samplers[r].num_known] for r in g], samplers[g[0]].request.client_id)
                for g in picked
            ])
            for k, g in enumerate(picked):
                rows[g] = new[k]
            for k, message in failed.items():
                errors[samplers[picked[k][0]].request_id] = message
        out = sample_on_host(rows, sampling)
        if self.config.normalize_log_probs:
            renormalized = [r for r, seq in enumerate(samplers) if _normalizes(seq)]
            if renormalized:
                params = np.array([samplers[r].sampling_params for r in renormalized], dtype=np.float64)
                processed = process_logits(rows, sampling)[renormalized]  # what the sampler picked from
                out.log_probs[renormalized] = normalized_log_probs(processed, out.token_ids[renormalized], params)
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

    # -- completion -------------------------------------------------------------------------

    def _complete_inflight(self) -> None:
        """Read back the step in flight (if any): put its tokens in place, answer,
        and free what finished."""
        step, self._inflight = self._inflight, None
        if step is None:
            return
        out = step.handle.result()
        for request_id, message in step.errors.items():
            self._fail_request(request_id, message)
        beams: dict[int, _Entry] = {}
        if out is not None:
            now = time.monotonic()
            # Python numbers once per step, not a numpy scalar per row.
            tokens, log_probs = out.token_ids.tolist(), out.log_probs.tolist()
            for row, (seq, pos) in enumerate(zip(step.samplers, step.positions, strict=True)):
                if pos == _VERIFIED:
                    continue  # a verification row: its sequence's rows are kept together below
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
                self._respond(seq)
            for seq, first, drafts in step.verify:
                if not seq.is_finished:
                    if seq.first_token_time is None:
                        seq.first_token_time = now
                    end = first + len(drafts) + 1
                    top = None if out.top_tokens is None or out.top_log_probs is None else (
                        out.top_tokens[first:end], out.top_log_probs[first:end])
                    self._accept(seq, drafts, tokens[first:end], log_probs[first:end], top)
        for entry in beams.values():
            if all(m.candidates is not None for m in entry.seqs):
                self._beam_step(entry)
        for seq in step.batch.seqs:
            if not seq.is_finished:
                self._register_blocks(seq)
        self._record_iteration(step)

    def _register_blocks(self, seq: Sequence) -> None:
        """Offer seq's computed full blocks to the prefix cache."""
        known = len(seq.token_ids) - seq.num_pending
        self.blocks.register_full_blocks(seq.blocks, seq.token_ids, min(seq.num_computed, known), seq.cache_salt)

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

    def _respond(self, seq: Sequence) -> None:
        """The response this sequence owes now, if any; frees it when finished."""
        request = seq.request
        final = seq.is_finished
        if not (request.streaming or final):
            return
        entry = self._entries[seq.request_id]
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
            self._out.stream(seq.request_id, output)  # the common case, in columns
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
            del self._entries[seq.request_id]
        self._out.responses.append(Response(seq.request_id, result=result, client_id=request.client_id))

    # -- beam search --------------------------------------------------------------------------

    def _beam_step(self, entry: _Entry) -> None:
        """Every beam has its candidates: pick the next beams (beam_search.advance)
        and, while streaming, report the best running ones."""
        assert entry.beam is not None
        if not beam_search.advance(entry.beam, entry.seqs, self.blocks, self.scheduler):
            self._end_beams(entry, FinishReason.NOT_FINISHED)
        elif entry.request.streaming:  # the best running beams so far (members are in score order)
            best = entry.seqs[: entry.request.num_return_sequences]
            beams = [(m.generated, m.log_probs, FinishReason.NOT_FINISHED) for m in best]
            self._out.responses.append(self._beam_response(entry, beams, final=False))

    def _end_beams(self, entry: _Entry, reason: FinishReason) -> None:
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
        del self._entries[entry.request_id]
        self._out.responses.append(
            self._beam_response(entry, hyps[: entry.request.num_return_sequences], final=True))

    def _beam_response(self, entry: _Entry, beams: list[beam_search.Beam], final: bool) -> Response:
        request = entry.request
        prompt = [] if request.output_config.exclude_input_from_output else list(request.input_token_ids)
        result = beam_search.beam_result(beams, prompt, request.output_config.return_log_probs, final)
        return Response(entry.request_id, result=result, client_id=request.client_id)

    # -- failures -----------------------------------------------------------------------------

    def _fail_request(self, request_id: int, message: str) -> None:
        """End one request with an error (its sequences are freed)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        for seq in entry.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                self._finish(seq, FinishReason.CANCELLED)
        self._out.responses.append(Response(request_id, error_msg=message, client_id=entry.request.client_id))

    def _fail_running(self, message: str) -> None:
        for request_id, entry in list(self._entries.items()):
            if any(s.num_pending or s.state in (RequestState.CONTEXT, RequestState.GENERATION) for s in entry.seqs):
                self._fail_request(request_id, message)

    # -- stats ----------------------------------------------------------------------------------

    def _record_iteration(self, step: _InFlight) -> None:
        self._iter += 1
        batch = step.batch
        self._out.iteration_stats.append(IterationStats(
            timestamp=time.time(),
            iter=self._iter,
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
            num_draft_tokens=self._num_drafted,
            num_accepted_draft_tokens=self._num_accepted,
            num_preempted=len(batch.preempted),
        ))
        if self.config.request_stats_max_iterations > 0:
            for entry in self._entries.values():
                self._record_request(entry.seqs[0])
        self._num_drafted = self._num_accepted = 0

    def _record_request(self, seq: Sequence) -> None:
        start = seq.arrival_time
        self._out.request_stats.append(RequestStats(
            request_id=seq.request_id,
            state=seq.state,
            prompt_tokens=seq.num_prompt_tokens,
            context_prefill_position=min(seq.num_computed, seq.num_prompt_tokens),
            num_generated_tokens=seq.num_generated,
            queue_time_ms=None if seq.first_scheduled_time is None else (seq.first_scheduled_time - start) * 1e3,
            time_to_first_token_ms=None if seq.first_token_time is None else (seq.first_token_time - start) * 1e3,
            allocated_blocks=len(seq.blocks.block_ids),
            reused_blocks=seq.num_cached_prompt // self.blocks.block_size,
            num_draft_tokens=0 if seq.spec is None else seq.spec.num_drafted,
            num_accepted_draft_tokens=0 if seq.spec is None else seq.spec.num_accepted,
            speculation_off_reason=seq.speculation_off_reason,
        ))
