"""The families beyond Llama on the CUDA path (Triton attention with soft-capping,
per-layer windows and sinks, per-layer rotary tables and layers without RoPE, q/k norms, GeGLU, the MoE expert
loop) token-identical to
transformers, in float32 so that argmax ties cannot part them; and the soft-capped
kernel against the torch reference in bf16."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpoints import make_checkpoint
from tests.worker.backends.greedy_driver import greedy_run
from worker.backends.paged_attention import PREFILL_BLOCK_Q, paged_attention_torch, paged_attention_triton, tile_map
from worker.backends.torch_backend import TorchBackend
from worker.models.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PROMPTS = {"p": [5, 17, 42, 99, 3, 250, 7, 8, 11], "q": [9, 8, 7], "r": list(range(30, 52))}


@pytest.mark.parametrize("name", ["qwen3_head_dim", "gemma2_capped", "gemma3_local_global", "phi3_window",
                                  "smollm3_nope_window", "mixtral_top2_window", "qwen3_moe_top4_dense_layer",
                                  "gpt_oss_sinks"])
def test_greedy_tokens_equal_transformers_on_cuda(name: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    directory = make_checkpoint(name, tmp_path / name)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    want = {}
    with torch.no_grad():
        for s, p in PROMPTS.items():
            ids = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None)
            want[s] = ids[0, len(p) :].tolist()
    backend = TorchBackend(load_model(directory), device="cuda", dtype="float32", max_model_len=64,
                           use_cuda_graphs=False)  # fmt: skip
    backend.allocate_kv_cache(num_blocks=96, block_size=4)
    assert greedy_run(backend, PROMPTS, 10, seed=5) == want


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("decode", [True, False])
def test_soft_capped_windowed_kernel_matches_reference_in_bf16(decode: bool, sinks: bool) -> None:
    rng = np.random.default_rng(2)
    heads, kv_heads, dim, block, window, cap = 8, 4, 256, 16, 40, 50.0
    ctx = rng.integers(1, 300, 6)
    q_lens = np.ones(6, dtype=np.int64) if decode else np.minimum(ctx, rng.integers(1, 100, 6))
    per_seq = -(-ctx // block)
    num_blocks = int(per_seq.sum()) + 3
    perm = rng.permutation(num_blocks)
    tables = np.zeros((6, int(per_seq.max())), dtype=np.int32)
    start = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = perm[start : start + nb]
        start += nb
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    k = torch.randn(num_blocks, block, kv_heads, dim, device=dev, dtype=bf16)
    v = torch.randn(num_blocks, block, kv_heads, dim, device=dev, dtype=bf16)
    query_start = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int64)
    q = torch.randn(int(query_start[-1]), heads, dim, device=dev, dtype=bf16) * 4
    block_q = 1 if decode else PREFILL_BLOCK_Q
    tile_seq, tile_q0 = tile_map(query_start, block_q)

    def i32(a: np.ndarray) -> torch.Tensor:
        return torch.tensor(a, dtype=torch.int32, device=dev)

    sink = torch.linspace(-2.0, 6.0, heads, device=dev, dtype=bf16) if sinks else None
    out = paged_attention_triton(q, k, v, i32(tables), i32(query_start), i32(ctx), i32(tile_seq), i32(tile_q0),
                                 block_q, 256**-0.5, window, softcap=cap, sinks=sink,
                                 splits=4 if decode else 1)  # fmt: skip
    tables64 = torch.tensor(tables, dtype=torch.int64, device=dev)
    ref = paged_attention_torch(q, k, v, tables64, query_start, ctx, 256**-0.5, window, cap, sink)
    # bf16 operands of P·V, as test_paged_attention_gpu.py holds the uncapped kernel to.
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
