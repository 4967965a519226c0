"""Turn a scheduled batch into the arrays a backend consumes."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np

from worker.backends.base import ForwardBatch, SamplingBatch
from worker.executor.penalties import banned_tokens, decayed_top_p, seen_tokens, uses_penalties
from worker.executor.scheduler import ScheduledBatch
from worker.executor.sequence import Sequence

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


def uniform_draws(seeds: np.ndarray, sequence_index: np.ndarray, step: np.ndarray) -> np.ndarray:
    """A counter-based draw in [0, 1) per (seed, sequence, step): the same request
    draws the same numbers whatever it is batched with, and after a preemption."""
    x = _splitmix64(seeds.astype(np.uint64))
    x = _splitmix64(x ^ sequence_index.astype(np.uint64))
    x = _splitmix64(x ^ step.astype(np.uint64))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def build_forward_batch(batch: ScheduledBatch, block_size: int, rows: list[int] | None = None,
                        extra_logits: list[tuple[int, int]] | None = None) -> ForwardBatch:
    """`rows[i]`: how many sampling rows sequence i's last token feeds (more than
    one when a leader's prompt ends and its siblings sample from the same logits).
    `extra_logits`: (first token, count) ranges of the packed batch whose logits
    are wanted too (context logits), after the sampling rows. A sequence with
    drafts (batch.drafts) gets a logits row for its last token and each draft."""
    if not extra_logits and all(n == 1 + len(d) and s.num_computed + 1 == s.num_tokens
                                for s, n, d in zip(batch.seqs, batch.num_new_tokens, batch.drafts, strict=True)):
        return generation_forward_batch(batch, block_size, rows)
    return packed_forward_batch(batch, block_size, rows, extra_logits)


def generation_forward_batch(batch: ScheduledBatch, block_size: int, rows: list[int] | None = None) -> ForwardBatch:
    """build_forward_batch of a step in which every sequence computes its last token
    and its drafts (decode and speculative verification): a few dozen tokens, built
    as Python lists and converted once, since the host's time per step adds to every
    verification step (the general path's ~50 numpy calls on tiny arrays cost more)."""
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    logits: list[int] = []
    tables: list[list[int]] = []
    for i, (seq, drafts) in enumerate(zip(batch.seqs, batch.drafts, strict=True)):
        first, a = seq.num_computed, query_start[-1]
        end = first + 1 + len(drafts)
        ids = seq.blocks.block_ids
        tokens.append(seq.token_ids[first])
        tokens += drafts
        positions += range(first, end)
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(first, end)]
        query_start.append(a + end - first)
        context_lens.append(end)
        if drafts:
            logits += range(a, a + len(drafts) + 1)
        else:
            logits += [a] * (1 if rows is None else rows[i])
        tables.append(ids)
    width = max(map(len, tables))
    return ForwardBatch(
        token_ids=np.array(tokens, dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        query_start=np.array(query_start, dtype=np.int64),
        context_lens=np.array(context_lens, dtype=np.int64),
        block_tables=np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64).reshape(len(tables),
                                                                                                  width),
        slot_mapping=np.array(slots, dtype=np.int64),
        logits_indices=np.array(logits, dtype=np.int64),
    )


def packed_forward_batch(batch: ScheduledBatch, block_size: int, rows: list[int] | None = None,
                         extra_logits: list[tuple[int, int]] | None = None) -> ForwardBatch:
    """build_forward_batch of any step: context chunks and generation tokens mixed."""
    seqs = batch.seqs
    counts = np.asarray(batch.num_new_tokens, dtype=np.int64)
    starts = np.fromiter((s.num_computed for s in seqs), dtype=np.int64, count=len(seqs))
    query_start = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start[1:])
    total = int(query_start[-1])

    if total == len(seqs) and max(batch.num_new_tokens) == 1:  # generation only: one new token each
        token_ids = np.fromiter((s.token_ids[s.num_computed] for s in seqs), dtype=np.int64, count=total)
    else:
        token_ids = np.empty(total, dtype=np.int64)
        # Python ints for the slicing: numpy scalars make this loop several times slower.
        for seq, a, n, lo, drafts in zip(seqs, query_start.tolist(), batch.num_new_tokens, starts.tolist(),
                                         batch.drafts, strict=False):
            if drafts:
                token_ids[a : a + n] = seq.token_ids[lo : lo + n - len(drafts)] + drafts
            else:
                token_ids[a : a + n] = seq.token_ids[lo : lo + n]
    # positions[t] = start of its sequence + offset within this step's chunk
    seq_of_token = np.repeat(np.arange(len(seqs)), counts)
    positions = starts[seq_of_token] + (np.arange(total) - query_start[:-1][seq_of_token])

    lengths = [len(s.blocks.block_ids) for s in seqs]
    block_tables = np.zeros((len(seqs), max(lengths)), dtype=np.int64)
    # One scatter of every sequence's ids: far cheaper than a row assignment each.
    owner = np.repeat(np.arange(len(seqs)), lengths)
    index = np.arange(len(owner)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    block_tables[owner, index] = np.fromiter(
        itertools.chain.from_iterable(s.blocks.block_ids for s in seqs), dtype=np.int64, count=len(owner)
    )
    slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size

    context_lens = starts + counts
    num_drafts = np.fromiter((len(d) for d in batch.drafts), dtype=np.int64, count=len(seqs))
    num_tokens = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))
    samples = context_lens == num_tokens + num_drafts
    logits_indices = query_start[1:][samples] - 1
    if num_drafts.any():
        # Verification rows (the last token's and each draft's, in order) for sequences
        # with drafts; the last token's row `rows[i]` times for the others.
        nd = num_drafts[samples]
        reps = np.ones_like(nd) if rows is None else np.asarray(rows, dtype=np.int64)[samples]
        width = np.where(nd > 0, nd + 1, reps)
        offsets = np.arange(int(width.sum())) - np.repeat(np.cumsum(width) - width, width)
        logits_indices = np.repeat(logits_indices - nd, width) + offsets * np.repeat(nd > 0, width)
    elif rows is not None:
        logits_indices = np.repeat(logits_indices, np.asarray(rows, dtype=np.int64)[samples])
    if extra_logits:
        extra = [np.arange(a, a + n, dtype=np.int64) for a, n in extra_logits]
        logits_indices = np.concatenate([logits_indices, *extra])
    return ForwardBatch(
        token_ids=token_ids,
        positions=positions,
        query_start=query_start,
        context_lens=context_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        logits_indices=logits_indices,
    )


def with_peft_inputs(forward: ForwardBatch, batch: ScheduledBatch, slots: list[int], vocab_size: int) -> ForwardBatch:
    """The step's LoRA slot of each token (`slots[i]`: sequence i's, -1 for none) and the
    embeddings of its prompt-tuning tokens (ids >= vocab_size, rows of their sequence's table)."""
    counts = np.diff(forward.query_start)
    lora_slots = np.repeat(np.asarray(slots, dtype=np.int64), counts) if max(slots) >= 0 else None
    rows: list[np.ndarray] = []
    embeds: list[np.ndarray] = []
    for seq, start, end in zip(batch.seqs, forward.query_start.tolist(), forward.query_start[1:].tolist(),
                               strict=False):
        if seq.prompt_table is not None:
            ids = forward.token_ids[start:end]
            virtual = np.flatnonzero(ids >= vocab_size)
            rows.append(virtual + start)
            embeds.append(seq.prompt_table[ids[virtual] - vocab_size])
    found = sum(len(r) for r in rows) > 0
    return replace(
        forward,
        lora_slots=lora_slots,
        prompt_rows=np.concatenate(rows) if found else None,
        prompt_embeds=np.concatenate(embeds) if found else None,
    )


def build_sampling_batch(seqs: list[Sequence], offsets: list[int] | None = None) -> SamplingBatch:
    """Sampling arrays for the sequences that sample this step, in batch order.
    `offsets[row]`: how many output positions past the sequence's next one the row
    decides (verification rows of speculative decoding: 0 .. k), so each row draws
    the uniform number of its own output position. Greedy rows read no draw: theirs is 0."""
    n = len(seqs)
    # A sequence's verification rows come one after another and all but their draws
    # depend on the sequence alone: the work below is per run of rows, not per row.
    run_seqs: list[Sequence] = []
    run_rows: list[int] = []
    for seq in seqs:
        if run_seqs and run_seqs[-1] is seq:
            run_rows[-1] += 1
        else:
            run_seqs.append(seq)
            run_rows.append(1)
    m = len(run_seqs)
    params = np.array([s.sampling_params for s in run_seqs], dtype=np.float64).reshape(m, 4)
    ban_rows: list[int] = []
    ban_tokens: list[int] = []
    bias_rows: list[int] = []
    penalty_rows: list[int] = []
    mask_rows: list[int] = []
    top_n = 0
    row = 0
    for u, (seq, count) in enumerate(zip(run_seqs, run_rows, strict=True)):
        rows = range(row, row + count)
        row += count
        banned = banned_tokens(seq)
        for r in rows:
            ban_rows += [r] * len(banned)
            ban_tokens += banned
        if seq.embedding_bias is not None:
            bias_rows += rows
        cfg = seq.request.sampling_config
        if uses_penalties(cfg):
            penalty_rows += rows
        if cfg.top_p_decay is not None:
            params[u, 2] = decayed_top_p(seq, params[u, 2])
        if seq.matcher is not None:
            mask_rows += rows
        top_n = max(top_n, seq.request.output_config.top_n_log_probs, 2 * cfg.beam_width if cfg.beam_width > 1 else 0)
    if m < n:
        params = np.repeat(params, run_rows, axis=0)
    temperature = params[:, 0].astype(np.float32)
    extra: dict[str, object] = {}
    if bias_rows:
        extra["bias_rows"] = np.asarray(bias_rows, dtype=np.int64)
        extra["bias"] = np.stack([seqs[r].embedding_bias for r in bias_rows])  # type: ignore[misc]
    if penalty_rows:
        extra.update(_penalties(seqs, penalty_rows))
    if mask_rows:
        from worker.executor.guided import fill_masks

        extra["mask_rows"] = np.asarray(mask_rows, dtype=np.int64)
        extra["token_mask"] = fill_masks([seqs[r].matcher for r in mask_rows])
    return SamplingBatch(
        temperature=temperature,
        top_k=params[:, 1].astype(np.int64),
        top_p=params[:, 2].astype(np.float32),
        min_p=params[:, 3].astype(np.float32),
        uniform=_draws(run_seqs, run_rows, temperature, offsets),
        ban_rows=np.asarray(ban_rows, dtype=np.int64),
        ban_tokens=np.asarray(ban_tokens, dtype=np.int64),
        top_n=top_n,
        **extra,  # type: ignore[arg-type]
    )


def _draws(run_seqs: list[Sequence], run_rows: list[int], temperature: np.ndarray,
           offsets: list[int] | None) -> np.ndarray:
    """Each sampled row's uniform draw (uniform_draws); 0 for greedy rows, which
    never read theirs (the hashing is most of a greedy step's sampling inputs)."""
    uniform = np.zeros(temperature.shape[0], dtype=np.float64)
    sampled = np.flatnonzero(temperature > 0)
    if not sampled.size:
        return uniform
    m = len(run_seqs)
    seeds = np.fromiter((s.seed for s in run_seqs), dtype=np.uint64, count=m)
    index = np.fromiter((s.sequence_index for s in run_seqs), dtype=np.uint64, count=m)
    steps = np.fromiter((s.num_generated for s in run_seqs), dtype=np.uint64, count=m)
    if m < temperature.shape[0]:
        seeds, index, steps = (np.repeat(a, run_rows) for a in (seeds, index, steps))
    if offsets is not None:
        steps += np.asarray(offsets, dtype=np.uint64)
    uniform[sampled] = uniform_draws(seeds[sampled], index[sampled], steps[sampled])
    return uniform


def _penalties(seqs: list[Sequence], rows: list[int]) -> dict[str, np.ndarray]:
    n = len(seqs)
    repetition = np.ones(n, dtype=np.float32)
    presence = np.zeros(n, dtype=np.float32)
    frequency = np.zeros(n, dtype=np.float32)
    seen_rows, seen_ids, seen_counts = [], [], []
    for row in rows:
        cfg = seqs[row].request.sampling_config
        repetition[row] = 1.0 if cfg.repetition_penalty is None else cfg.repetition_penalty
        presence[row] = cfg.presence_penalty or 0.0
        frequency[row] = cfg.frequency_penalty or 0.0
        ids, counts = seen_tokens(seqs[row])
        seen_rows.append(np.full(len(ids), row, dtype=np.int64))
        seen_ids.append(ids)
        seen_counts.append(counts)
    return {
        "repetition_penalty": repetition,
        "presence_penalty": presence,
        "frequency_penalty": frequency,
        "seen_rows": np.concatenate(seen_rows),
        "seen_tokens": np.concatenate(seen_ids),
        "seen_counts": np.concatenate(seen_counts),
    }
