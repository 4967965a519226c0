"""The engine core: continuous batching one step at a time, with no threads,
no locks and no I/O.

`step()` is the whole loop in one screen: schedule the next batch, launch it,
and complete the step launched by the previous call while this one runs on the
device (overlap scheduling). The step in flight is handed from one call to the
next and completed in one place. `Launcher.must_complete_first` is the one rule
for when a step may not overlap the next: when the next schedule depends on its
tokens (beams, verifications, host sampling, drafts that follow them) it
completes in the call that launched it; when the next batch reads its tokens
(penalties, grammars) or runs on the host, that batch is held until the step in
flight has completed, and launched right after, in the same call.

The work is done by collaborators, each a module with its own state, that never
call back into the core:
- request_table.py: the requests in flight and the one place a request ends;
- intake.py: the checks a request passes and the sequences it runs as;
- lora_registry.py: the LoRA adapters and their device slots;
- siblings.py: the returned sequences of n > 1 sampling, forked from their leader;
- speculative.py: draft proposals before a schedule, acceptance after;
- launcher.py: a batch's inputs and its launch (host_logits.py for host steps);
- completion.py: tokens in place, stop rules, responses, beams, stats;
- embeddings.py: requests that want the prompt's pooled hidden state, answered
  in forwards of their own at the start of a step, never scheduled.
A new capability lands as one more of these, not as core methods.

Whoever drives the core does the I/O around `step()`, and the waiting: the
in-process `Executor` (a thread and queues) or the worker's engine process
(pipes to the worker). When `stalled` is set, requests wait but nothing fitted
and nothing is in flight: the driver waits for a cancel or a new request before
stepping again. LoRA adapters are read from disk by `register_lora`, which the
driver calls between steps (or `load_lora` on any thread, then `add_lora`).

Request ids are the caller's: the core answers under the id a request came with.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from worker.backends.base import Backend, HostKvBackend
from worker.executor.block_manager import BlockManager
from worker.executor.completion import Completion
from worker.executor.draft_model import DraftModel
from worker.executor.embeddings import Embeddings
from worker.executor.intake import Intake
from worker.executor.launcher import InFlight, Launcher
from worker.executor.logits_processors import load_processors
from worker.executor.lora_registry import LoraRegistry
from worker.executor.request_table import RequestTable
from worker.executor.scheduler import ScheduledBatch, Scheduler
from worker.executor.siblings import Siblings
from worker.executor.speculative import Speculation
from worker.executor.step_output import StepOutput
from worker.executor.types import ExecutorConfig, Request
from worker.models.lora import LoraAdapter
from worker.models.pooling import DEFAULT_POOLING, checkpoint_pooling

__all__ = ["EngineCore", "StepOutput"]

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, backend: Backend, config: ExecutorConfig | None = None, *, tokenizer: Any = None,
                 chat_template: str | None = None, draft: DraftModel | None = None,
                 pooling: str = DEFAULT_POOLING) -> None:
        """A core over a ready backend (`from_model` loads one). `tokenizer` is needed
        only by guided decoding; `chat_template` is carried for the APIs above;
        `draft`: the draft model of speculative decoding, if any (it gets as many KV
        blocks as the target); `pooling`: how the model's embeddings are pooled when a
        request names no pooling (worker/models/pooling.py)."""
        self.config = config = config or ExecutorConfig()
        self.backend = backend
        self.draft = draft
        if draft is not None and draft.backend.config.vocab_size != backend.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.backend.config.vocab_size} tokens) is not "
                             f"the target's ({backend.config.vocab_size}): they must share the tokenizer")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.model_config = backend.config
        self.max_seq_len = self.model_config.max_position_embeddings
        self.processors: dict[str, Any] = dict(config.logits_post_processor_map or {})
        for name, fn in load_processors(config.logits_post_processors).items():
            if name in self.processors:
                raise ValueError(f"logits post-processor {name!r} is configured twice")
            self.processors[name] = fn

        kv = config.kv_cache_config
        lora = LoraRegistry(backend, config, self.model_config)  # its slots take memory the KV cache cannot
        num_blocks = self._num_kv_blocks()
        backend.allocate_kv_cache(num_blocks, kv.tokens_per_block)
        if draft is not None:
            draft.allocate(num_blocks, kv.tokens_per_block)
        host_blocks = self._num_host_kv_blocks()
        self.blocks = BlockManager(num_blocks, kv.tokens_per_block, kv.enable_block_reuse, host_blocks)
        self.scheduler = Scheduler(config, self.blocks)
        self.lora = lora.attach(self.scheduler)
        self.table = RequestTable(self.scheduler)
        self.siblings = Siblings(self.blocks, self.scheduler)
        self.intake = Intake(config, self.model_config, self.max_seq_len, self.blocks, lora, self.processors,
                             self.table, self.siblings, tokenizer=tokenizer, has_draft_model=draft is not None)
        self.speculation = Speculation(draft, self.blocks, self.max_seq_len)
        self.launcher = Launcher(backend, config, self.blocks, lora, self.processors)
        self.completion = Completion(config, self.table, self.scheduler, self.blocks, self.speculation,
                                     self.max_seq_len)
        self.embeddings = Embeddings(backend, config, self.blocks, self.table, self.max_seq_len, pooling)
        self._inflight: InFlight | None = None  # the step launched and not read back yet
        self._held: ScheduledBatch | None = None  # scheduled, launched once the step in flight has completed
        self.stalled = False  # the last step found requests waiting, none fitting and none in flight
        log.info("engine core: backend=%s kv_blocks=%d x %d tokens (max_batch_size=%d sequences of up to %d "
                 "tokens each), host kv_blocks=%d", backend.name, num_blocks, kv.tokens_per_block,
                 config.max_batch_size, num_blocks * kv.tokens_per_block // config.max_batch_size, host_blocks)
        # The configured adapters are read here, as the model is by from_model: a core is
        # ready to serve them once built.
        for name, path in config.lora_adapters.items():
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
                                 parallel=cfg.parallel_config, kv_cache_dtype=cfg.kv_cache_config.dtype,
                                 deterministic=cfg.deterministic)
        draft = None
        if cfg.draft_model is not None:
            draft = DraftModel.load(cfg.draft_model, cfg.backend, cfg.device, cfg.dtype,
                                    cfg.max_num_tokens, cfg.max_batch_size)
        return cls(backend, cfg, tokenizer=loaded.tokenizer, chat_template=loaded.chat_template, draft=draft,
                   pooling=checkpoint_pooling(loaded.source))

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

    def _num_host_kv_blocks(self) -> int:
        """The host tier's blocks (KvCacheConfig.host_cache_size), allocated on the backend."""
        kv = self.config.kv_cache_config
        if not kv.host_cache_size:
            return 0
        if not isinstance(self.backend, HostKvBackend):
            raise ValueError(f"host_cache_size: the {self.backend.name} backend has no host KV cache tier")
        if not kv.enable_block_reuse:
            raise ValueError("host_cache_size needs enable_block_reuse: the host tier keeps reusable prefix blocks")
        block_bytes = self.backend.kv_bytes_per_token() * kv.tokens_per_block
        if kv.host_cache_size < block_bytes:
            raise ValueError(f"host_cache_size {kv.host_cache_size} bytes is less than one KV block "
                             f"({block_bytes} bytes)")
        blocks = kv.host_cache_size // block_bytes
        self.backend.allocate_host_kv_cache(blocks)
        return blocks

    # -- LoRA adapters (called by the driver between steps) -------------------------------

    def register_lora(self, name: str, path: str) -> None:
        """Read, check and register a PEFT adapter under `name` (replacing one of that
        name for new requests). CheckpointError names what is wrong with it."""
        self.add_lora(name, path, self.load_lora(path))

    def add_lora(self, name: str, path: str, adapter: LoraAdapter) -> None:
        """Register an adapter already read from `path` (a driver reads it off its engine thread)."""
        self.lora.on().add(name, path, adapter)

    def load_lora(self, path: str) -> LoraAdapter:
        """Read and check an adapter against the model; no state changes (safe from any thread)."""
        return self.lora.on().load(path)

    def unregister_lora(self, name: str) -> None:
        """New requests can no longer name it; queued ones fail, running ones finish under it."""
        key = self.lora.on().remove(name)
        for seq in list(self.scheduler.waiting):
            if seq.adapter == key:
                self.table.fail(seq.request_id, f"LoRA adapter {name!r} was unloaded")

    def lora_names(self) -> list[str]:
        return self.lora.names()

    # -- what the driver calls ----------------------------------------------------------

    def add_requests(self, requests: Iterable[tuple[int, Request]]) -> None:
        """Start requests under the caller's ids; an invalid one (or an id already in
        flight) ends with an error response in the next step's output."""
        for request_id, request in requests:
            if request.embedding_config is not None:
                self.embeddings.admit(request_id, request)
            else:
                self.intake.admit(request_id, request)

    def abort(self, request_id: int) -> None:
        """Cancel a request: it ends with a CANCELLED final response (unknown or
        finished ids are ignored)."""
        entry = self.table.get(request_id)
        if entry is not None:
            self.completion.cancel(entry)
        else:
            self.embeddings.cancel(request_id)

    @property
    def has_work(self) -> bool:
        """Whether `step()` has anything to do: requests to run, a step in flight, or output to hand over."""
        return (self.scheduler.has_work or self._inflight is not None or self._held is not None
                or bool(self.table.out) or bool(self.embeddings.waiting))

    def load(self) -> tuple[int, int, int]:
        """(queued, active, free KV blocks)."""
        return len(self.scheduler.waiting), len(self.scheduler.running), self.blocks.num_free

    def step(self) -> StepOutput:
        """One iteration: schedule and launch step N, complete step N - 1 while N runs
        on the device, and complete N too when the next schedule depends on its
        tokens. A batch held for step N - 1's tokens launches in the same call, once
        they are in place: the device would otherwise wait through the driver's turn."""
        self.embeddings.run()
        self._turn()
        if self._held is not None:
            self._turn()
        return self.table.take_output()

    def _turn(self) -> None:
        """Schedule (or take the held batch), launch, complete what is due. A backend
        failure ends the requests that were running, not the core."""
        previous, self._inflight = self._inflight, None
        batch, self._held = self._held, None
        launched = None
        try:
            if batch is not None:
                batch.drop_finished()  # held while `previous` completed: a token read back may have ended one
            else:
                self.speculation.propose(self.scheduler.running)
                batch = self.scheduler.schedule()
                for request_id, message in self.lora.take_errors().items():
                    self.table.fail(request_id, message)
            if batch and previous is not None and self.launcher.must_complete_first(previous, batch):
                self._held = batch  # launched by the next call, on the tokens completed below
            elif batch:
                launched = self.launcher.launch(batch, self.siblings.fork(batch))
            due = [previous]
            if launched is not None and self.launcher.must_complete_first(launched, None):
                due.append(launched)
                launched = None
            for step in due:  # the one completion site
                if step is not None:
                    self.completion.complete(step)
            self._inflight = launched
        except Exception as e:
            log.exception("engine step failed")
            self._held = None
            self.table.fail_running(f"internal error in the executor step: {e}")
        self.stalled = previous is None and not batch and self._inflight is None and self.scheduler.has_work
