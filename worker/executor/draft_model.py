"""The draft-model source of speculative decoding: a smaller model sharing the
target's tokenizer, run by the same core on a backend of its own with its own
paged KV, proposing k tokens greedily per step.

Each proposal first catches the draft's KV up with the sequence (the tokens
accepted since its last proposal, or the whole prompt the first time), then runs
k - 1 single-token steps on its own proposals. Its KV keeps what it computed:
the next proposal recomputes only from the first token where the sequence
left the draft's guesses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from worker.backends.base import Backend, ForwardBatch, SamplingBatch
from worker.executor.block_manager import BlockManager, BlockTable, OutOfBlocksError
from worker.executor.sequence import Sequence


@dataclass(eq=False, slots=True)
class _DraftKV:
    table: BlockTable = field(default_factory=BlockTable)
    tokens: list[int] = field(default_factory=list)  # whose K/V the draft cache holds, in order
    confirmed: int = 0  # leading entries of `tokens` known to equal the sequence's


def _common_prefix(a: list[int], b: list[int], start: int) -> int:
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _greedy(num_rows: int) -> SamplingBatch:
    empty = np.zeros(0, dtype=np.int64)
    return SamplingBatch(
        temperature=np.zeros(num_rows, dtype=np.float32),
        top_k=np.zeros(num_rows, dtype=np.int64),
        top_p=np.ones(num_rows, dtype=np.float32),
        min_p=np.zeros(num_rows, dtype=np.float32),
        uniform=np.zeros(num_rows, dtype=np.float64),
        ban_rows=empty,
        ban_tokens=empty,
    )


class DraftModel:
    def __init__(self, backend: Backend, max_num_tokens: int) -> None:
        """Over a loaded backend; `allocate` gives it its KV cache."""
        self.backend = backend
        self.max_num_tokens = max_num_tokens  # tokens per draft forward (catch-up chunks)
        self.blocks: BlockManager | None = None
        self._kv: dict[Sequence, _DraftKV] = {}

    @classmethod
    def load(cls, path: str | Path, backend: str, device: str | None, dtype: str | None,
             max_num_tokens: int, max_batch_size: int) -> DraftModel:
        """Load a checkpoint the way EngineCore.from_model loads the target."""
        from worker.models.loader import load_model

        return cls.from_loaded(load_model(path), backend, device, dtype, max_num_tokens, max_batch_size)

    @classmethod
    def from_loaded(cls, loaded: Any, backend: str, device: str | None, dtype: str | None,
                    max_num_tokens: int, max_batch_size: int) -> DraftModel:
        """Over a LoadedModel (worker.models.loaded_model) already in memory."""
        from worker.backends.device import create_backend

        return cls(create_backend(loaded, backend, device, dtype, max_num_tokens=max_num_tokens,
                                  max_batch_size=max_batch_size), max_num_tokens)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.backend.allocate_kv_cache(num_blocks, block_size)
        self.blocks = BlockManager(num_blocks, block_size, enable_reuse=False)

    @property
    def tables(self) -> list[BlockTable]:
        return [kv.table for kv in self._kv.values()]

    def retain(self, live: list[Sequence]) -> None:
        """Free the draft KV of every sequence not in `live` (finished, preempted, cancelled)."""
        assert self.blocks is not None
        keep = set(live)
        for seq in [s for s in self._kv if s not in keep]:
            self.blocks.free(self._kv.pop(seq).table)

    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to k greedy draft tokens for each (sequence, k), whose tokens are all
        known. A sequence whose catch-up does not fit this call's token budget, or
        whose draft KV does not fit, gets none this time."""
        assert self.blocks is not None
        drafts: list[list[int]] = [[] for _ in wanted]
        # (index into wanted, kv, first position to feed, tokens to feed, whether it drafts)
        chunks: list[tuple[int, _DraftKV, int, list[int], bool]] = []
        budget = self.max_num_tokens
        for i, (seq, k) in enumerate(wanted):
            kv = self._kv.setdefault(seq, _DraftKV())
            tokens = seq.token_ids
            # The sequence only grows: what the draft computed stays valid up to the
            # first token where the sequence left the draft's own guesses.
            valid = min(_common_prefix(kv.tokens, tokens, kv.confirmed), len(tokens) - 1)
            del kv.tokens[valid:]
            kv.confirmed = valid
            n = min(len(tokens) - valid, budget)
            if n <= 0:
                continue
            drafts_now = n == len(tokens) - valid
            try:
                self.blocks.ensure_capacity(kv.table, valid + n + (k - 1 if drafts_now else 0))
            except OutOfBlocksError:
                self.blocks.free(kv.table)
                del self._kv[seq]
                continue
            chunks.append((i, kv, valid, tokens[valid : valid + n], drafts_now))
            budget -= n
        if not chunks:
            return drafts
        # Catch up (and the first draft token), then one token per step for the rest.
        rows = [(i, kv) for i, kv, _, _, d in chunks if d]
        firsts = self._run([(kv, start, toks, d) for _, kv, start, toks, d in chunks])
        for _, kv, _, toks, _ in chunks:
            kv.tokens.extend(toks)
        for (i, _kv), token in zip(rows, firsts, strict=True):
            drafts[i].append(token)
        while True:
            step = [(i, kv) for i, kv in rows if len(drafts[i]) < wanted[i][1]]
            if not step:
                break
            feed = [(kv, len(kv.tokens), [drafts[i][-1]], True) for i, kv in step]
            for i, kv in step:
                kv.tokens.append(drafts[i][-1])
            for (i, _kv), token in zip(step, self._run(feed), strict=True):
                drafts[i].append(token)
        return drafts

    def _run(self, chunks: list[tuple[_DraftKV, int, list[int], bool]]) -> list[int]:
        """One forward over (kv, first position, tokens, wants logits) chunks; the
        greedy next token after each chunk that wants logits."""
        assert self.blocks is not None
        bs = self.blocks.block_size
        counts = np.array([len(t) for _, _, t, _ in chunks], dtype=np.int64)
        starts = np.array([s for _, s, _, _ in chunks], dtype=np.int64)
        query_start = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        token_ids = np.fromiter((t for _, _, toks, _ in chunks for t in toks), dtype=np.int64,
                                count=int(query_start[-1]))
        seq_of_token = np.repeat(np.arange(len(chunks)), counts)
        positions = starts[seq_of_token] + (np.arange(len(token_ids)) - query_start[:-1][seq_of_token])
        width = max(len(kv.table.block_ids) for kv, _, _, _ in chunks)
        block_tables = np.zeros((len(chunks), width), dtype=np.int64)
        for row, (kv, _, _, _) in enumerate(chunks):
            block_tables[row, : len(kv.table.block_ids)] = kv.table.block_ids
        slot_mapping = block_tables[seq_of_token, positions // bs] * bs + positions % bs
        wants = np.array([w for _, _, _, w in chunks], dtype=bool)
        batch = ForwardBatch(
            token_ids=token_ids,
            positions=positions,
            query_start=query_start,
            context_lens=starts + counts,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            logits_indices=query_start[1:][wants] - 1,
        )
        logits = self.backend.forward(batch)
        if not wants.any():
            return []
        out = self.backend.sample(logits, _greedy(int(wants.sum())))
        return [int(t) for t in out.token_ids.tolist()]


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def first_layers(loaded: Any, num_layers: int) -> Any:
    """The model's first `num_layers` decoder layers with its own embedding, final
    norm and head: a draft sharing the target's weights and tokenizer (early-exit
    self-speculation). Its acceptance is lower than a distilled draft's; the bench
    and tests use it where no smaller model of the same family is at hand."""
    config = loaded.config
    if not 1 <= num_layers <= config.num_layers:
        raise ValueError(f"num_layers must be in [1, {config.num_layers}], got {num_layers}")

    def kept(name: str) -> bool:
        m = _LAYER.match(name)
        return m is None or int(m.group(1)) < num_layers

    return replace(
        loaded,
        config=replace(config, num_layers=num_layers,
                       sliding_layers=tuple(i for i in config.sliding_layers if i < num_layers)),
        weights={k: v for k, v in loaded.weights.items() if kept(k)},
        tensor_refs={k: v for k, v in loaded.tensor_refs.items() if kept(k)},
        hf_config={**loaded.hf_config, "num_hidden_layers": num_layers},
    )
