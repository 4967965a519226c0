"""The CUDA-graph step layout on the CPU: which graph (batch bucket, q) a step gets,
and that a step laid out for a graph (sequences padded to q query tokens, the
batch padded to its bucket, KV lengths raised by the padding) gives each wanted
row the logits transformers gives, without touching any sequence's KV. The CPU
torch backend runs the padded inputs through the same forward the graphs capture."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.worker.backends.paged_batches import PagedSequences
from worker.backends.base import ForwardBatch
from worker.backends.cuda_graphs import (
    MAX_QUERY,
    DecodeGraphs,
    fastest_buckets,
    graph_inputs,
    layout,
    query_width,
)
from worker.backends.torch_backend import TorchBackend
from worker.models.loader import load_model

LOGITS_ATOL = 1e-4  # float32 on both sides, as in test_torch_backend.py
BLOCK_SIZE = 4


def hf_logits(directory: Path, tokens: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def padded_forward(backend: TorchBackend, graphs: DecodeGraphs, batch: ForwardBatch) -> np.ndarray:
    """What DecodeGraphs.run computes, on the CPU: the (bucket, q) layout through the forward, then the gather."""
    key = graphs.key(batch)
    assert key is not None
    b, q = key
    meta = np.zeros(3 * b * q + b, dtype=np.int32)
    rows = layout(batch, b, q, backend.scratch_slot, meta)
    tables = np.zeros((b, graphs.table_width), dtype=np.int32)
    tables[: batch.num_seqs, : batch.block_tables.shape[1]] = batch.block_tables
    seq_lens = meta[3 * b * q :].astype(np.int64)
    inputs = graph_inputs(torch.from_numpy(meta), torch.from_numpy(tables), b, q, 1, seq_lens_host=seq_lens)
    with torch.inference_mode():
        logits = backend.run_model(inputs).numpy()
    assert logits.shape[0] == b * q
    return logits[: batch.logits_indices.shape[0]] if rows is None else logits[rows]


def test_padded_verification_step_gives_transformers_logits(tiny_llama: Path) -> None:
    backend = TorchBackend(load_model(tiny_llama), device="cpu")
    backend.allocate_kv_cache(num_blocks=64, block_size=BLOCK_SIZE)
    graphs = DecodeGraphs(backend, 16, 32, max_verify_batch=8, max_tokens=256, block_size=BLOCK_SIZE)
    rng = np.random.default_rng(3)
    vocab = backend.config.vocab_size
    # Lengths chosen so some sequence's raised KV length crosses into a block it does not own.
    seqs = {s: rng.integers(0, vocab, n).tolist() for s, n in (("a", 30), ("b", 17), ("c", 24))}
    want = {s: hf_logits(tiny_llama, t) for s, t in seqs.items()}
    paged = PagedSequences(num_blocks=64, block_size=BLOCK_SIZE)
    backend.forward(paged.step([("a", seqs["a"], 0, 20), ("b", seqs["b"], 0, 16), ("c", seqs["c"], 0, 15)]))
    # a verifies 4 drafts (5 tokens), b decodes one token, c verifies 8 drafts (9 tokens):
    # q = 9, 3 sequences in bucket 4.
    step = [("a", seqs["a"], 20, 5), ("b", seqs["b"], 16, 1), ("c", seqs["c"], 15, 9)]
    batch = paged.step(step)
    assert graphs.key(batch) == (4, 9)
    got = padded_forward(backend, graphs, batch)
    row = 0
    for name, _, start, count in step:
        diff = float(np.abs(got[row : row + count] - want[name][start : start + count]).max())
        assert diff < LOGITS_ATOL, f"{name}[{start}:{start + count}] max |diff| {diff:.2e}"
        row += count
    # Padded rows wrote only the scratch slot: the next tokens still see the right KV.
    after = [("a", seqs["a"], 25, 5), ("b", seqs["b"], 17, 0), ("c", seqs["c"], 24, 0)]
    tail = backend.logits_to_host(backend.forward(paged.step([p for p in after if p[3]])))
    assert float(np.abs(tail - want["a"][25:30]).max()) < LOGITS_ATOL


def test_uniform_step_needs_no_gather(tiny_llama: Path) -> None:
    """Every sequence with q tokens and every row wanted: the graph's first rows, in order."""
    backend = TorchBackend(load_model(tiny_llama), device="cpu")
    backend.allocate_kv_cache(num_blocks=32, block_size=BLOCK_SIZE)
    paged = PagedSequences(num_blocks=32, block_size=BLOCK_SIZE)
    tokens = list(range(5, 40))
    backend.forward(paged.step([("x", tokens, 0, 12), ("y", tokens, 0, 9)]))
    batch = paged.step([("x", tokens, 12, 3), ("y", tokens, 9, 3)])
    meta = np.zeros(3 * 2 * 3 + 2, dtype=np.int64)
    assert layout(batch, 2, 3, backend.scratch_slot, meta) is None
    np.testing.assert_array_equal(meta[18:], [15, 12])  # KV lengths as they are
    wanted_last = paged.step([("x", tokens, 15, 3), ("y", tokens, 12, 3)], all_logits=False)
    meta = np.zeros(3 * 4 * 3 + 4, dtype=np.int64)
    rows = layout(wanted_last, 4, 3, backend.scratch_slot, meta)
    assert rows is not None
    np.testing.assert_array_equal(rows, [2, 5])
    np.testing.assert_array_equal(meta[36:], [18, 15, 0, 0])  # padded sequences: no keys
    np.testing.assert_array_equal(meta[24:36], [*wanted_last.slot_mapping, *[backend.scratch_slot] * 6])


def test_graph_keys_are_bounded(tiny_llama: Path) -> None:
    backend = TorchBackend(load_model(tiny_llama), device="cpu")
    backend.allocate_kv_cache(num_blocks=256, block_size=BLOCK_SIZE)
    graphs = DecodeGraphs(backend, 64, 40, max_verify_batch=24, max_tokens=160, block_size=BLOCK_SIZE)
    paged = PagedSequences(num_blocks=256, block_size=BLOCK_SIZE)
    tokens = list(range(3, 60))

    def step(counts: list[int]) -> ForwardBatch:
        return paged.step([(f"s{i}", tokens, 10, n) for i, n in enumerate(counts)], all_logits=False)

    assert graphs.key(step([1] * 5)) == (8, 1)  # decode, as before
    assert graphs.key(step([1] * 40)) == (40, 1)
    assert graphs.key(step([2, 1, 1])) == (4, 2)
    assert graphs.key(step([MAX_QUERY, 1])) == (2, MAX_QUERY)
    assert graphs.key(step([MAX_QUERY + 1])) is None  # longer: a prefill chunk, eager
    assert graphs.key(step([3] * 25)) is None  # more sequences than verification graphs take
    assert graphs.key(step([9] * 17 + [1])) is None  # 24 * 9 tokens: past the activation budget
    assert graphs.key(step([8] * 17 + [1])) is None
    assert graphs.key(step([6] * 17 + [1])) == (24, 6)
    keys = {graphs.key(step([q] + [1] * (n - 1))) for n in range(1, 25) for q in range(2, MAX_QUERY + 1)}
    verify_buckets = [b for b in graphs.buckets if b <= 24]
    assert len(keys - {None}) <= len(verify_buckets) * (MAX_QUERY - 1)
    assert query_width(step([1, 4, 2])) == 4


def test_a_bucket_runs_in_the_fastest_graph_at_or_above_it() -> None:
    # Replay times (us a layer) shaped like the 8B's bf16 GEMMs on an H100, where cuBLAS's 448-row
    # gate_up takes 288 us and its 512-row one 157.
    micros = {256: 201.0, 320: 260.0, 384: 300.0, 448: 429.0, 512: 296.0}
    routes = fastest_buckets(micros)
    assert routes == {256: 256, 320: 320, 384: 384, 448: 512, 512: 512}  # 384: 296 is within 5 % of 300
    assert fastest_buckets({8: 20.0, 16: 5.0, 24: 4.0}) == {8: 24, 16: 24, 24: 24}
    assert fastest_buckets({8: 5.0, 16: 20.0}) == {8: 8, 16: 16}  # never a smaller graph
    assert fastest_buckets({8: 10.0, 16: 9.6}) == {8: 8, 16: 16}  # a near tie keeps the batch's own


def test_a_batch_routed_to_a_larger_graph_gives_transformers_logits(tiny_llama: Path) -> None:
    """A decode step laid out for the graph its bucket routes to (more padded sequences)."""
    backend = TorchBackend(load_model(tiny_llama), device="cpu")
    backend.allocate_kv_cache(num_blocks=64, block_size=BLOCK_SIZE)
    graphs = DecodeGraphs(backend, 16, 32, block_size=BLOCK_SIZE)
    graphs.routes = fastest_buckets({1: 30.0, 2: 30.0, 4: 30.0, 8: 50.0, 16: 20.0})
    rng = np.random.default_rng(5)
    seqs = {s: rng.integers(0, backend.config.vocab_size, n).tolist() for s, n in (("a", 21), ("b", 14), ("c", 9))}
    paged = PagedSequences(num_blocks=64, block_size=BLOCK_SIZE)
    backend.forward(paged.step([(s, t, 0, len(t) - 1) for s, t in seqs.items()]))
    batch = paged.step([(s, t, len(t) - 1, 1) for s, t in seqs.items()])
    assert graphs.key(batch) == (16, 1)  # bucket 4, routed to 16
    got = padded_forward(backend, graphs, batch)
    for row, (name, tokens) in enumerate(seqs.items()):
        diff = float(np.abs(got[row] - hf_logits(tiny_llama, tokens)[-1]).max())
        assert diff < LOGITS_ATOL, f"{name}: max |diff| {diff:.2e}"


@pytest.mark.parametrize("q", [2, 5, MAX_QUERY])
def test_padded_sequences_attend_to_nothing(tiny_llama: Path, q: int) -> None:
    """A padded sequence (KV length 0) gives finite rows and reads no cache block."""
    backend = TorchBackend(load_model(tiny_llama), device="cpu")
    backend.allocate_kv_cache(num_blocks=8, block_size=BLOCK_SIZE)
    b = 2
    meta = np.zeros(3 * b * q + b, dtype=np.int32)
    meta[2 * b * q : 3 * b * q] = backend.scratch_slot
    tables = torch.zeros((b, 4), dtype=torch.int32)
    inputs = graph_inputs(torch.from_numpy(meta), tables, b, q, 1, seq_lens_host=np.zeros(b, dtype=np.int64))
    with torch.inference_mode():
        logits = backend.run_model(inputs)
    assert logits.shape == (b * q, backend.config.vocab_size)
    assert bool(torch.isfinite(logits).all())
