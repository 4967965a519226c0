"""Embedding requests: the prompt's final hidden state, pooled, instead of generation.

A request with `embedding_config` needs one prefill and nothing after it: no
sampling, no KV cache once its vector is made, no place among the sequences the
scheduler grows. So it never enters the scheduler. Each engine step first runs
the waiting embedding requests in forwards of their own, packed up to
max_num_tokens tokens and max_batch_size sequences (a prompt longer than
max_num_tokens in chunks, each attending to the KV of the chunks before it), and
answers them in that step's output with the vector and no tokens.

Their KV blocks are taken from the free pool and given back before this module
returns, never hashed: the scheduler's reservations (GUARANTEED_NO_EVICT counts
the blocks free between its calls) are never short of one, and no prefix cache
entry claims KV that was computed for a request that is gone. A request waits
while the free pool cannot hold its prompt.

Pooling (worker/models/pooling.py): "last" takes the last prompt token's state,
"mean" the average over every prompt token; either is then scaled to unit L2
norm, as sentence-transformers' Normalize module and OpenAI's API do."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from protocol.model_fit import token_outside_vocabulary
from worker.backends.base import Backend, ForwardBatch, HiddenStateBackend
from worker.executor import kv_transfers
from worker.executor.block_manager import BlockManager, BlockTable
from worker.executor.request_table import RequestTable
from worker.executor.types import ExecutorConfig, FinishReason, Request, Response, Result
from worker.models.pooling import POOLINGS

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class _Waiting:
    request_id: int
    request: Request
    pooling: str  # "last" | "mean"
    blocks: BlockTable = field(default_factory=BlockTable)
    computed: int = 0  # prompt tokens whose hidden state was computed
    # "mean": the sum of the hidden rows so far, in float64 so a long prompt's sum loses nothing;
    # "last": the last token's row, once computed.
    pooled: np.ndarray | None = None

    @property
    def tokens(self) -> list[int]:
        return self.request.input_token_ids


class Embeddings:
    def __init__(self, backend: Backend, config: ExecutorConfig, blocks: BlockManager, table: RequestTable,
                 max_seq_len: int, pooling: str) -> None:
        """`pooling`: the model's own (checkpoint_pooling), for requests that name none."""
        self.backend = backend
        # None: the backend cannot hand back hidden states, and embedding requests are refused.
        self.hidden: HiddenStateBackend | None = backend if isinstance(backend, HiddenStateBackend) else None
        self.blocks = blocks
        self.table = table
        self.max_seq_len = max_seq_len
        self.max_num_tokens = config.max_num_tokens
        self.max_batch_size = config.max_batch_size
        self.pooling = pooling
        self.vocab_size = backend.config.vocab_size
        self.waiting: OrderedDict[int, _Waiting] = OrderedDict()

    def admit(self, request_id: int, request: Request) -> None:
        """Queue an embedding request, or answer it with an error naming the problem."""
        problem = self._problem(request_id, request)
        if problem is not None:
            self.table.reject(request_id, request, problem)
            return
        assert request.embedding_config is not None
        pooling = request.embedding_config.pooling or self.pooling
        self.waiting[request_id] = _Waiting(request_id, request, pooling)

    def _problem(self, request_id: int, request: Request) -> str | None:
        assert request.embedding_config is not None
        if request_id in self.waiting or request_id in self.table:
            return f"request id {request_id} is already in flight"
        if self.hidden is None:
            return f"embeddings are not available on the {self.backend.name} backend"
        prompt = request.input_token_ids
        if not prompt:
            return "input_token_ids is empty: an embedding needs at least one token"
        problem = token_outside_vocabulary(prompt, self.vocab_size)
        if problem is not None:
            return problem
        if len(prompt) > self.max_seq_len:
            return f"the input ({len(prompt)} tokens) exceeds the model's context of {self.max_seq_len} tokens"
        pooling = request.embedding_config.pooling
        if pooling is not None and pooling not in POOLINGS:
            return f"embedding_config.pooling must be one of {list(POOLINGS)}, got {pooling!r}"
        if pooling is None and self.pooling not in POOLINGS:
            return (f"the model's pooling ({self.pooling}) is not supported; name one of {list(POOLINGS)} in "
                    "embedding_config.pooling")
        if request.lora_config is not None or request.prompt_tuning_config is not None:
            return "lora_config and prompt_tuning_config are not supported with embedding_config"
        if self.blocks.blocks_for(len(prompt)) > self.blocks.num_blocks:
            return (f"the input ({len(prompt)} tokens) needs {self.blocks.blocks_for(len(prompt))} KV cache blocks, "
                    f"but the cache holds {self.blocks.num_blocks}")
        return None

    def cancel(self, request_id: int) -> bool:
        """End a waiting embedding request as cancelled; False when it is not one of these."""
        entry = self.waiting.pop(request_id, None)
        if entry is None:
            return False
        self._answer(entry, None, FinishReason.CANCELLED)
        return True

    def run(self) -> None:
        """Embed the requests that fit now: as many as the free KV pool holds, in order, up
        to max_num_tokens tokens (the first one always, however long: in chunks)."""
        if not self.waiting:
            return
        batch: list[_Waiting] = []
        tokens = blocks = 0
        for entry in self.waiting.values():
            n = len(entry.tokens)
            if batch and (tokens + n > self.max_num_tokens or len(batch) == self.max_batch_size):
                break
            if blocks + self.blocks.blocks_for(n) > self.blocks.num_free:
                break  # it waits for blocks; those after it wait their turn
            batch.append(entry)
            tokens, blocks = tokens + n, blocks + self.blocks.blocks_for(n)
        if not batch:
            return
        for entry in batch:
            del self.waiting[entry.request_id]
            self.blocks.ensure_capacity(entry.blocks, len(entry.tokens))
        try:
            while any(e.computed < len(e.tokens) for e in batch):
                self._forward([e for e in batch if e.computed < len(e.tokens)])
        except Exception as e:  # a backend failure ends these requests, not the engine
            log.exception("embedding forward failed")
            for entry in batch:
                self.table.out.responses.append(Response(entry.request_id, error_msg=f"internal error in the "
                                                         f"embedding forward: {e}",
                                                         client_id=entry.request.client_id))
            return
        finally:
            for entry in batch:
                self.blocks.free(entry.blocks)
        for entry in batch:
            self._answer(entry, _pooled(entry), FinishReason.LENGTH)

    def _forward(self, batch: list[_Waiting]) -> None:
        """One forward over the next chunk of each of `batch`'s prompts (max_num_tokens in
        all), adding its hidden rows to their pooled state."""
        chunks: list[tuple[_Waiting, int, int]] = []  # (request, first position, count)
        budget = self.max_num_tokens
        for entry in batch:
            if budget == 0:
                break
            n = min(len(entry.tokens) - entry.computed, budget)
            chunks.append((entry, entry.computed, n))
            budget -= n
        forward, rows = self._forward_batch(chunks)
        kv_transfers.issue(self.blocks.take_transfers(), self.backend)  # the blocks it took may be evicted ones
        assert self.hidden is not None  # admit refused every request otherwise
        hidden = self.hidden.hidden_states(forward)
        for (entry, start, n), (lo, hi) in zip(chunks, rows, strict=True):
            entry.computed = start + n
            if entry.pooling == "mean":
                part = hidden[lo:hi].astype(np.float64).sum(axis=0)
                entry.pooled = part if entry.pooled is None else entry.pooled + part
            elif hi > lo:  # "last": the chunk that ends the prompt has its one row
                entry.pooled = hidden[lo].astype(np.float64)

    def _forward_batch(self, chunks: list[tuple[_Waiting, int, int]]) -> tuple[ForwardBatch, list[tuple[int, int]]]:
        """The packed step of `chunks`, and each chunk's range of rows in the hidden states
        it returns: every row for mean pooling, the prompt's last for last-token pooling."""
        block_size = self.blocks.block_size
        counts = np.array([n for _, _, n in chunks], dtype=np.int64)
        query_start = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        token_ids = np.concatenate([np.asarray(e.tokens[a : a + n], dtype=np.int64) for e, a, n in chunks])
        positions = np.concatenate([np.arange(a, a + n, dtype=np.int64) for _, a, n in chunks])
        width = max(len(e.blocks.block_ids) for e, _, _ in chunks)
        tables = np.zeros((len(chunks), width), dtype=np.int64)
        for i, (entry, _, _) in enumerate(chunks):
            tables[i, : len(entry.blocks.block_ids)] = entry.blocks.block_ids
        owner = np.repeat(np.arange(len(chunks)), counts)
        slots = tables[owner, positions // block_size] * block_size + positions % block_size
        wanted: list[np.ndarray] = []
        rows: list[tuple[int, int]] = []
        at = 0
        for (entry, a, n), first in zip(chunks, query_start.tolist(), strict=False):
            if entry.pooling == "mean":
                picked = np.arange(first, first + n, dtype=np.int64)
            elif a + n == len(entry.tokens):
                picked = np.array([first + n - 1], dtype=np.int64)
            else:
                picked = np.empty(0, dtype=np.int64)
            wanted.append(picked)
            rows.append((at, at + len(picked)))
            at += len(picked)
        forward = ForwardBatch(
            token_ids=token_ids,
            positions=positions,
            query_start=query_start,
            context_lens=np.array([a + n for _, a, n in chunks], dtype=np.int64),
            block_tables=tables,
            slot_mapping=slots,
            logits_indices=np.concatenate(wanted),
        )
        return forward, rows

    def _answer(self, entry: _Waiting, vector: np.ndarray | None, reason: FinishReason) -> None:
        # No tokens and a final result: LENGTH says the output is complete (it has none to give).
        result = Result(is_final=True, output_token_ids=[[]], finish_reasons=[reason], is_sequence_final=True,
                        embedding=vector)
        self.table.out.responses.append(Response(entry.request_id, result, client_id=entry.request.client_id))


def _pooled(entry: _Waiting) -> np.ndarray:
    """The request's embedding: its pooled hidden state at unit L2 norm, float32 [hidden]."""
    assert entry.pooled is not None
    vector = entry.pooled / len(entry.tokens) if entry.pooling == "mean" else entry.pooled
    norm = float(np.linalg.norm(vector))
    # A zero vector has no direction to keep; it is returned as it is rather than as NaNs.
    return (vector / norm if norm > 0 else vector).astype(np.float32)
