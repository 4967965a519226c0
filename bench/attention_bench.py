"""The decode attention kernel alone, per keys-per-iteration tile, against its cache bytes at
copy bandwidth: how the tile size chosen by `paged_attention.keys_per_iter` compares with
the others at a model's head shape.

One decode step of one layer: every sequence one query token over `context` cached
tokens, its blocks scattered over the cache, timed as 20 calls replayed from a CUDA graph.

    python3 -m bench.attention_bench                                  # Gemma 3 12B's heads
    python3 -m bench.attention_bench --heads 32 --kv-heads 8 --head-dim 128   # Llama 3 8B's

Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from bench import SkipSection
from bench.device_rates import graph_call_seconds, measure_bandwidth

TITLE = "Decode attention: µs a layer per keys-per-iteration tile"
SHAPES = [(512, 192), (256, 1024), (128, 1536), (64, 4096)]  # (sequences, context)
BLOCK_SIZE = 32


def layer_seconds(seqs: int, context: int, args: argparse.Namespace, cache_dtype: torch.dtype, keys: int) -> float:
    from worker.backends import paged_attention as pa

    dev = torch.device("cuda")
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = seqs * blocks_per_seq
    g = torch.Generator(device=dev).manual_seed(0)
    tables = torch.randperm(num_blocks, device=dev, generator=g).to(torch.int32).view(seqs, blocks_per_seq)
    shape = (num_blocks, BLOCK_SIZE, args.kv_heads, args.head_dim)
    k = torch.randn(shape, device=dev, generator=g).to(cache_dtype)
    v = torch.randn(shape, device=dev, generator=g).to(cache_dtype)
    q = torch.randn(seqs, args.heads, args.head_dim, device=dev, generator=g).to(torch.bfloat16)
    seq_lens = torch.full((seqs,), context, dtype=torch.int32, device=dev)
    query_start = torch.arange(seqs + 1, dtype=torch.int32, device=dev)
    tile_seq, tile_q0 = query_start[:-1], torch.zeros(seqs, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    splits = pa.decode_splits(seqs, args.kv_heads, torch.cuda.get_device_properties(dev).multi_processor_count)
    chosen = pa.keys_per_iter
    pa.keys_per_iter = lambda block_d, block_size, fp8_decode: keys  # the tile under test, for this call only
    try:
        return graph_call_seconds(
            lambda: pa.paged_attention_triton(q, k, v, tables, query_start, seq_lens, tile_seq, tile_q0, 1,
                                              args.head_dim**-0.5, out=out, splits=splits),
            dev,
        )  # fmt: skip
    finally:
        pa.keys_per_iter = chosen


def table(argv: Sequence[str] = ()) -> tuple[list[str], list[list[str]]]:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SkipSection("no CUDA device")
    from worker.backends.paged_attention import keys_per_iter

    bandwidth = measure_bandwidth(torch.device("cuda"))
    block_d = 1 << (args.head_dim - 1).bit_length()
    header = ["cache", "seqs x context", "KV MB", "floor us", *(f"{n} keys us" for n in args.keys), "chosen"]
    rows = []
    for name, dtype in (("e4m3", torch.float8_e4m3fn), ("bf16", torch.bfloat16)):
        for seqs, context in SHAPES:
            kv_bytes = 2 * seqs * context * args.kv_heads * args.head_dim * dtype.itemsize
            times = [layer_seconds(seqs, context, args, dtype, n) * 1e6 for n in args.keys]
            chosen = keys_per_iter(block_d, BLOCK_SIZE, fp8_decode=dtype.itemsize == 1)
            rows.append([name, f"{seqs} x {context}", f"{kv_bytes / 1e6:.0f}", f"{kv_bytes / bandwidth * 1e6:.0f}",
                         *(f"{t:.1f}" for t in times), str(chosen)])  # fmt: skip
    return header, rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--keys", type=lambda s: [int(x) for x in s.split(",")], default=[32, 64, 128],
                   help="keys per iteration to time, comma-separated powers of two")  # fmt: skip
    return p


def main() -> None:
    from bench.run import format_table

    try:
        header, rows = table(sys.argv[1:])
    except SkipSection as e:
        sys.exit(f"bench.attention_bench: {e}")
    print(TITLE)
    print(format_table(header, rows))


if __name__ == "__main__":
    main()
