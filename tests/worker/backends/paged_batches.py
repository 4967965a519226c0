"""Build ForwardBatch arrays by hand for backend tests, on scattered KV blocks."""

from __future__ import annotations

import numpy as np

from worker.backends.base import ForwardBatch


class PagedSequences:
    """Sequences whose KV blocks are drawn at random from a pool, so block tables are
    non-contiguous and padded with block 0, which another sequence may own."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(np.random.default_rng(seed).permutation(num_blocks))
        self.tables: dict[str, list[int]] = {}

    def step(self, parts: list[tuple[str, list[int], int, int]], all_logits: bool = True) -> ForwardBatch:
        """parts: (sequence name, its tokens, first position, number of new tokens)."""
        bs = self.block_size
        token_ids, positions, slots, starts, context_lens = [], [], [], [0], []
        for name, tokens, start, count in parts:
            table = self.tables.setdefault(name, [])
            while len(table) * bs < start + count:
                table.append(int(self.free.pop()))
            for p in range(start, start + count):
                token_ids.append(tokens[p])
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            starts.append(starts[-1] + count)
            context_lens.append(start + count)
        width = max(len(self.tables[name]) for name, *_ in parts)
        tables = np.zeros((len(parts), width), dtype=np.int64)
        for i, (name, *_) in enumerate(parts):
            tables[i, : len(self.tables[name])] = self.tables[name]
        query_start = np.asarray(starts, dtype=np.int64)
        logits_indices = np.arange(len(token_ids)) if all_logits else query_start[1:] - 1
        return ForwardBatch(
            token_ids=np.asarray(token_ids, dtype=np.int64),
            positions=np.asarray(positions, dtype=np.int64),
            query_start=query_start,
            context_lens=np.asarray(context_lens, dtype=np.int64),
            block_tables=tables,
            slot_mapping=np.asarray(slots, dtype=np.int64),
            logits_indices=np.asarray(logits_indices, dtype=np.int64),
        )
