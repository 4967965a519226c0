"""One sequence being generated: its tokens, its KV blocks and its progress."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from worker.executor.block_manager import BlockTable
from worker.executor.spec_state import SpecState
from worker.executor.types import FinishReason, PromptLogProbs, Request, RequestState


@dataclass(eq=False, slots=True)
class Family:
    """The sequences of one request. They share the prompt's KV blocks: the
    leader computes the prompt, then the others fork its block table (beams,
    and the returned sequences of sampling)."""

    width: int  # how many sequences it grows to: beam width, or num_return_sequences
    is_beam: bool = False
    members: list[Sequence] = field(default_factory=list)  # live sequences, leader first


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: int
    request: Request
    token_ids: list[int]  # prompt + generated
    num_prompt_tokens: int
    end_id: int
    stop_words: list[list[int]]
    bad_words: list[list[int]]
    seed: int
    # (temperature, top_k, top_p, min_p) with defaults resolved; temperature 0 is greedy
    sampling_params: tuple[float, float, float, float]
    sequence_index: int = 0
    state: RequestState = RequestState.QUEUED
    blocks: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_prompt: int = 0  # prompt tokens found in the prefix cache
    num_host_cached_prompt: int = 0  # of those, the tokens its host tier held
    num_emitted: int = 0  # generated tokens already sent in a streaming response
    # Trailing entries of token_ids that are placeholders for tokens a launched
    # step is still sampling (see AsyncBackend.launch).
    num_pending: int = 0
    log_probs: list[float] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)  # per generated token, when asked
    top_log_probs: list[list[float]] = field(default_factory=list)
    family: Family | None = None  # set for every sequence the executor creates
    embedding_bias: np.ndarray | None = None  # float32 [vocab]
    matcher: Any = None  # the grammar matcher of a guided request (guided.py)
    # Beam search: this beam's next-token candidates from its last step (tokens,
    # log probs), held until every beam of the family has its own.
    candidates: tuple[np.ndarray, np.ndarray] | None = None
    # Speculative decoding: its state (None: the request does not speculate), and the
    # tokens proposed for the next step (set before each schedule).
    spec: SpecState | None = None
    draft: list[int] = field(default_factory=list)
    speculation_off_reason: str | None = None  # why a request that asked to speculate does not
    # LoRA: the registration of the request's adapter (adapter_cache.AdapterKey), None for the base model.
    adapter: tuple[str, int] | None = None
    # Prompt tuning: the request's embedding table, float32 [rows, hidden] (token id t >= vocab
    # stands for row t - vocab).
    prompt_table: np.ndarray | None = None
    # What the prefix cache keys this sequence's blocks by beside their tokens (the adapter,
    # the prompt table): KV computed under one never serves another. None: the base model's.
    cache_salt: int | None = None
    context_logits: list[np.ndarray] = field(default_factory=list)  # one row per prompt token, when asked
    prompt_log_probs: PromptLogProbs | None = None  # collected as the prompt runs, when asked
    generation_logits: list[np.ndarray] = field(default_factory=list)  # one row per generated token
    finish_reason: FinishReason = FinishReason.NOT_FINISHED
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated(self) -> list[int]:
        """Generated tokens the host knows, without pending placeholders."""
        return self.token_ids[self.num_prompt_tokens : len(self.token_ids) - self.num_pending]

    @property
    def reached_max_tokens(self) -> bool:
        return self.num_generated >= self.request.max_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def in_prefill(self) -> bool:
        """True while more than the last token still needs computing: the
        prompt, or the prompt plus generated tokens after a preemption."""
        return self.num_uncomputed > 1 or self.num_computed == 0

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host knows (prompt + generated, less placeholders)."""
        return len(self.token_ids) - self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.finish_reason != FinishReason.NOT_FINISHED

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.request.max_tokens

    def finish(self, reason: FinishReason) -> None:
        """Mark it finished; drop the placeholders of steps still in flight."""
        self.finish_reason = reason
        if self.num_pending:
            del self.token_ids[len(self.token_ids) - self.num_pending :]
            self.num_pending = 0
