"""Quantized kernels on CUDA against their dequantized reference, and the FP8 KV cache
against the bf16 one.

Tolerances (relative L2 of the output, ||ours - ref|| / ||ref||):
- W4A16: the kernel dequantizes to bf16 in registers (relative rounding 2^-9 per weight)
  and accumulates in float32; against x @ W_dequantized in float32 that is ~3e-3 on
  random data; bound 1e-2.
- FP8 GEMM: the reference rounds the inputs to e4m3 exactly as the kernel does, so what
  remains is the bf16 output rounding and summation order: ~2e-3; bound 1e-2. The Triton
  FP8 GEMM against cuBLAS on the same codes: only the summation order and the bf16
  rounding differ (~1e-3); bound 5e-3. Through a model the e4m3 rounding of each layer's
  input amplifies such differences (see the tests).
- FP8 KV cache vs bf16 cache, mid-size model: e4m3 keeps 3 mantissa bits (relative error
  <= 2^-4 per K/V element); the logits move by a relative L2 of a few percent; bound 0.1.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.worker.backends.greedy_driver import greedy_run
from tests.worker.backends.paged_batches import PagedSequences
from worker.backends import fp8_gemm, quant_linear
from worker.backends.torch_backend import TorchBackend
from worker.models.config import ModelConfig
from worker.models.loader import load_model
from worker.models.quantization import Int4Weight, dequantize, pack_int4, quantize_int4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("m", [1, 3, 16, 64, 300, 2048])
@pytest.mark.parametrize(("group", "zero"), [(128, None), (128, "int"), (64, "float"), (32, "int"), (32, "float")])
def test_w4a16_matches_the_dequantized_reference(m: int, group: int, zero: str | None) -> None:
    """Both kernels (batch 1: the GEMV, whose tiles of 64 inputs hold two groups of 32; more
    rows: the tiled one, reproducible bit for bit where it splits K) for a checkpoint's
    integer zero points and the float ones quantizing on load makes."""
    rng = np.random.default_rng(m)
    n, k = 1536, 4096
    q = rng.integers(-8, 8, (n, k)).astype(np.int8)
    z = None
    if zero == "int":
        z = rng.integers(-3, 3, (n, k // group)).astype(np.int8)
    elif zero == "float":
        z = rng.uniform(-3, 3, (n, k // group)).astype(np.float32)
    w = Int4Weight(pack_int4(q), (rng.random((n, k // group)) * 0.01).astype(np.float32), z, group)
    layer = quant_linear.quantized_linear([w], None, None, CUDA)
    assert isinstance(layer, quant_linear.Int4Linear)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    ref = x.float() @ torch.from_numpy(dequantize(w)).to(CUDA).T
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert rel(out, ref) < 1e-2, (m, rel(out, ref))
    if m > 1:
        assert torch.equal(layer(x), out)


@pytest.mark.parametrize("m", [1, 5])
def test_w4a16_on_load_quantization_at_smollm2_width(m: int) -> None:
    """Groups of 32, asymmetric with float zeros, as the CPU quantizer makes them; 576 inputs
    are not a multiple of 128, so the batch-1 kernel walks tiles of 64 (two groups each)."""
    w = torch.randn(576 * 3, 576, device=CUDA) * 0.05
    layer = quant_linear.quantized_linear([w], None, "int4", CUDA)
    assert isinstance(layer, quant_linear.Int4Linear) and layer.group_size == 32 and layer.zero is not None
    cpu = torch.from_numpy(dequantize(quantize_int4(w.cpu().numpy())))
    # the same grid; a division a last bit apart may round a rare weight to the next level
    assert float(((quant_linear.dequantize_int4(layer).cpu() - cpu).abs() > 1e-5).float().mean()) < 1e-4
    x = torch.randn(m, 576, device=CUDA, dtype=torch.bfloat16)
    assert rel(layer(x), x.float() @ quant_linear.dequantize_int4(layer).T) < 1e-2


@pytest.mark.parametrize("m", [1, 16, 300, 2048])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_gemm_matches_the_reference(m: int, static: bool) -> None:
    n, k = 2048, 4096
    w = torch.randn(n, k, device=CUDA) * 0.02
    layer = quant_linear.quantized_linear([w], torch.randn(n, device=CUDA, dtype=torch.bfloat16), "fp8", CUDA)
    assert isinstance(layer, quant_linear.Fp8Linear)
    if static:
        layer = quant_linear.Fp8Linear(layer.weight, layer.scale, torch.tensor([[0.02]], device=CUDA), layer.bias)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    dequantized = layer.weight.float() * layer.scale[0][:, None]
    assert layer.bias is not None
    ref = quant_linear.Fp8Reference(dequantized, layer.bias.float(), 0.02 if static else None)(x.float())
    assert rel(layer(x), ref) < 1e-2, (m, static, rel(layer(x), ref))


@pytest.mark.parametrize("m", [3, 16, 300])
@pytest.mark.parametrize("tile", fp8_gemm.TILES, ids=str)
def test_triton_fp8_gemm_matches_cublas(m: int, tile: fp8_gemm.Tile) -> None:
    n, k = 2000, 4096  # partial column tiles at every BLOCK_N
    xq, x_scale = quant_linear.quantize_rows_fp8(torch.randn(m, k, device=CUDA, dtype=torch.bfloat16))
    layer = quant_linear.quantize_fp8(torch.randn(n, k, device=CUDA) * 0.02, None)
    got = fp8_gemm.fp8_matmul(xq, x_scale, layer.weight, layer.scale, torch.bfloat16, tile)
    want = fp8_gemm.scaled_mm(xq, x_scale, layer.weight, layer.scale, torch.bfloat16)
    assert rel(got, want) < 5e-3, rel(got, want)


def test_a_tile_the_device_cannot_run_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    runnable = fp8_gemm.TILES[0]
    too_deep = fp8_gemm.Tile(128, 256, 20, 8)  # 20 stages of 48 KB: more shared memory than any GPU has
    monkeypatch.setattr(fp8_gemm, "TILES", (too_deep, runnable))
    layer = quant_linear.quantize_fp8(torch.randn(1024, 1024, device=CUDA) * 0.02, None)
    (timing,) = fp8_gemm.tune(64, [(layer.weight, layer.scale)], torch.bfloat16)
    assert timing.fastest == runnable and timing.triton_us < float("inf")
    monkeypatch.setattr(fp8_gemm, "TILES", (too_deep,))
    (timing,) = fp8_gemm.tune(64, [(layer.weight, layer.scale)], torch.bfloat16)
    assert timing.fastest is None and timing.kept is None  # cuBLAS it is


def decode_logits(backend: TorchBackend, prompts: dict[str, list[int]]) -> torch.Tensor:
    """One eager prefill of every prompt, then one decode step of them all (a CUDA graph)."""
    paged = PagedSequences(num_blocks=128, block_size=16, seed=3)
    backend.forward(paged.step([(s, p, 0, len(p)) for s, p in prompts.items()], all_logits=False))
    step = paged.step([(s, [*p, 7], len(p), 1) for s, p in prompts.items()], all_logits=False)
    return backend.forward(step).clone()


def recapture_in_own_buckets(backend: TorchBackend) -> None:
    """Drop the decode graphs captured with the KV cache, so that the next steps capture them
    with the GEMM tiles as they are now, each batch in its own bucket's graph (a route to a
    larger graph would run that graph's tiles)."""
    assert backend._graphs is not None
    backend._graphs.graphs.clear()
    backend._graphs.routes = {}


def test_fp8_graphs_tune_their_row_counts_and_run_the_tile_chosen() -> None:
    cfg = mid_config()
    weights = mid_weights(cfg)
    backends = []
    for _ in range(2):
        backend = TorchBackend(cfg, CUDA, weights=weights, quantization="fp8", max_graph_batch=64)
        backend.allocate_kv_cache(num_blocks=128, block_size=16)
        backends.append(backend)
    tuned, plain = backends
    # the graphs' row counts (one row is the GEMV's), a prefill chunk's
    assert sorted(tuned.fp8_gemm_timings) == [2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 8192]
    linears = [getattr(layer, role) for layer in tuned.model.layers for role in ("qkv", "o", "gate_up", "down")]
    for rows, timings in tuned.fp8_gemm_timings.items():
        assert len(timings) == 4  # qkv, o, gate_up and down differ in shape
        for t in timings:
            assert t.kept is None or (t.kept == t.fastest and t.triton_us <= fp8_gemm.MARGIN * t.cublas_us)
            for linear in linears:
                if tuple(linear.weight.shape) == (t.out_features, t.in_features):
                    assert (linear.eager_tiles if rows == 8192 else linear.graph_tiles).get(rows) == t.kept
    # 16 sequences decode in the 16-row graph: every projection on a Triton tile, against cuBLAS
    for linear in linears:
        linear.graph_tiles[16] = fp8_gemm.TILES[0]
    for layer in plain.model.layers:
        for role in ("qkv", "o", "gate_up", "down"):
            getattr(layer, role).graph_tiles.clear()
    recapture_in_own_buckets(tuned)
    recapture_in_own_buckets(plain)
    prompts = {str(i): np.random.default_rng(i).integers(0, 4096, 9 + i).tolist() for i in range(16)}
    got, want = decode_logits(tuned, prompts), decode_logits(plain, prompts)
    assert not torch.equal(got, want), "the graph ran cuBLAS, not the Triton tile"
    # The products differ by their summation order and bf16 rounding only (the GEMM tests
    # above: < 5e-3), but every next layer rounds its input to e4m3, where a tiny shift moves
    # a value across a code boundary: the bound of the CPU-reference comparison above, for
    # the same reason (0.095 measured on an H100).
    assert rel(got, want) < 0.25, rel(got, want)


def test_fp8_full_prefill_chunk_runs_the_eager_tile() -> None:
    cfg = mid_config()
    weights = mid_weights(cfg)
    tuned, plain = (TorchBackend(cfg, CUDA, weights=weights, quantization="fp8", use_cuda_graphs=False,
                                 max_num_tokens=64) for _ in range(2))  # fmt: skip
    logits = []
    for backend, tile in ((tuned, fp8_gemm.TILES[1]), (plain, None)):
        backend.allocate_kv_cache(num_blocks=64, block_size=16)
        assert sorted(backend.fp8_gemm_timings) == [64]  # no graphs: the full chunk's row count alone
        for layer in backend.model.layers:
            for role in ("qkv", "o", "gate_up", "down"):
                tiles = getattr(layer, role).eager_tiles
                tiles.clear()
                if tile is not None:
                    tiles[64] = tile
        prompts = {s: np.random.default_rng(i).integers(0, 4096, 32).tolist() for i, s in enumerate("ab")}
        step = PagedSequences(64, 16, seed=2).step([(s, p, 0, 32) for s, p in prompts.items()])  # 64 rows
        logits.append(backend.forward(step).clone())
    assert not torch.equal(logits[0], logits[1]), "the prefill chunk ran cuBLAS, not the Triton tile"
    assert rel(logits[0], logits[1]) < 0.25, rel(logits[0], logits[1])  # as in the graph test above


def test_fp8_row_quantization_kernel_matches_torch() -> None:
    x = torch.randn(37, 4096, device=CUDA, dtype=torch.bfloat16) * 3
    q, scale = quant_linear.quantize_rows_fp8(x)
    want_scale = x.float().abs().amax(dim=1, keepdim=True) / 448.0
    torch.testing.assert_close(scale, want_scale)
    want = (x.float() / want_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert (q.view(torch.uint8) != want.view(torch.uint8)).float().mean() < 1e-3  # division rounding ties only


def mid_config() -> ModelConfig:
    return ModelConfig.from_hf({
        "model_type": "llama", "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    })  # fmt: skip


def mid_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from worker.models.loaded_model import expected_shapes

    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, device=CUDA)
        else:
            out[name] = torch.randn(shape, device=CUDA, generator=gen) * 0.05
    return out


@pytest.mark.parametrize("quantization", ["fp8", "int4"])
def test_quantized_model_cuda_graphs_match_eager_and_stay_near_the_reference(quantization: str) -> None:
    cfg = mid_config()
    weights = mid_weights(cfg)
    prompts = {s: np.random.default_rng(i).integers(0, 4096, 20 + 7 * i).tolist() for i, s in enumerate("abcd")}
    runs = []
    for graphs in (True, False):
        backend = TorchBackend(cfg, CUDA, weights=weights, quantization=quantization, use_cuda_graphs=graphs)
        backend.allocate_kv_cache(num_blocks=128, block_size=16)
        if graphs:  # each batch in its own bucket's graph, the FP8 GEMMs on cuBLAS: as eager steps run them
            for layer in backend.model.layers:
                for role in ("qkv", "o", "gate_up", "down"):
                    linear = getattr(layer, role)
                    if isinstance(linear, quant_linear.Fp8Linear):
                        linear.graph_tiles.clear()
            recapture_in_own_buckets(backend)
        runs.append(greedy_run(backend, prompts, 16, seed=1, block_size=16, num_blocks=128, chunk=64))
    # The W4A16 tiled kernel sums its split-K planes in a fixed order: runs are reproducible.
    assert runs[0] == runs[1]
    # one prefill's logits against the CPU reference of the same quantization (float32)
    tokens = prompts["d"]
    gpu = TorchBackend(cfg, CUDA, weights=weights, quantization=quantization, use_cuda_graphs=False)
    cpu = TorchBackend(cfg, "cpu", "float32", weights={k: v.cpu() for k, v in weights.items()},
                       quantization=quantization)  # fmt: skip
    logits = []
    for backend in (gpu, cpu):
        backend.allocate_kv_cache(num_blocks=16, block_size=16)
        logits.append(backend.forward(PagedSequences(16, 16, seed=1).step([("s", tokens, 0, len(tokens))])).cpu())
    # FP8 quantizes every linear's input per token to e4m3 (3 mantissa bits): bf16 inputs on the
    # GPU and float32 ones on the CPU round to different e4m3 values near a boundary, one e4m3
    # step (6-12%) apart, and four layers carry that on (0.15 measured on an H100). The
    # GEMMs themselves are checked against the dequantized reference above, at tight bounds.
    bound = 0.25 if quantization == "fp8" else 3e-2
    assert rel(logits[0], logits[1]) < bound, rel(logits[0], logits[1])


def test_fp8_kv_cache_doubles_the_tokens_and_stays_close_to_bf16() -> None:
    cfg = mid_config()
    weights = mid_weights(cfg)
    tokens = np.random.default_rng(3).integers(0, 4096, 400).tolist()
    out, per_token = {}, {}
    for kv in (None, "fp8"):
        backend = TorchBackend(cfg, CUDA, weights=weights, kv_cache_dtype=kv, use_cuda_graphs=False)
        per_token[kv] = backend.kv_bytes_per_token()
        backend.allocate_kv_cache(num_blocks=64, block_size=16)
        paged = PagedSequences(64, 16, seed=2)
        rows = [backend.forward(paged.step([("s", tokens, 0, 300)])).clone()]
        rows += [backend.forward(paged.step([("s", tokens, p, 1)])).clone() for p in range(300, 400)]
        out[kv] = torch.cat(rows)
    assert per_token[None] == 2 * per_token["fp8"]
    err = rel(out["fp8"], out[None])
    agree = float((out["fp8"].argmax(-1) == out[None].argmax(-1)).float().mean())
    print(f"fp8 KV cache vs bf16: logits relative L2 {err:.3e}, argmax agreement {agree:.3f}")
    # e4m3 keys and values with no calibrated scale (3 mantissa bits): on this random model, whose
    # logits are flat, an H100 measured 0.086 relative L2 and 0.855 argmax agreement.
    assert err < 0.1
    assert agree >= 0.8


def default_model_path() -> Path | None:
    path = os.environ.get("TOKENWIRE_GPU_DEFAULT_MODEL")
    return Path(path) if path and Path(path).exists() else None


@pytest.mark.skipif(default_model_path() is None, reason="TOKENWIRE_GPU_DEFAULT_MODEL (the default model) not set")
def test_default_model_quantized_on_load_agreement() -> None:
    """Next-token argmax agreement with the bf16 model over 20 prompts of 64 tokens
    (teacher-forced, 1280 positions); the printed figures are the ones to report. The
    goal is 90%. int4 on load finds the default model's own Q4_1 grid (groups of 32, float
    zeros) and gives its weights back: the CPU measured 1.000, so only bf16 rounding and the
    kernels' summation order move a near-tie here. fp8 W8A8 (per-channel weights, per-token
    activations) does not reach it on this 135M model: the CPU's emulation (Fp8Reference)
    measured 0.873 on these prompts (0.86-0.88 over four prompt sets; fp8 weights alone 0.89-
    0.91): its logits are flat (the top two within half a logit at 37% of positions) and e4m3's
    3 mantissa bits on every weight and every projection's input move them by about that much. The fp8 floor guards
    against regressions only."""
    path = default_model_path()
    assert path is not None
    loaded = load_model(path, load_weights=False)
    ids = loaded.tokenizer.encode((Path(__file__).parents[2] / "README.md").read_text()).ids
    prompts = [ids[i * 97 : i * 97 + 64] for i in range(20)]

    def argmaxes(quantization: str | None) -> Any:
        backend = TorchBackend(load_model(path, quantization=quantization), device="cuda", use_cuda_graphs=False)
        backend.allocate_kv_cache(num_blocks=100, block_size=16)
        batch = PagedSequences(100, 16, seed=1).step([(str(i), p, 0, 64) for i, p in enumerate(prompts)])
        return backend.forward(batch).argmax(-1).cpu()

    base = argmaxes(None)
    figures = {q: float((argmaxes(q) == base).float().mean()) for q in ("fp8", "int4")}
    print(f"default model, next-token agreement with bf16 over 20 x 64 tokens: {figures}")
    assert figures["fp8"] >= 0.8
    assert figures["int4"] >= 0.9


def test_w4a16_batch_one_repeats_and_replays_in_a_graph() -> None:
    """The batch-1 kernel leaves its split-K counters at zero for the next call and adds the
    splits' partial sums in a fixed order: repeated calls, and replays of a captured graph,
    give the same product, bit for bit."""
    w = torch.randn(6144, 4096, device=CUDA) * 0.05
    layer = quant_linear.quantized_linear([w], None, "int4", CUDA)
    assert isinstance(layer, quant_linear.Int4Linear)
    x = torch.randn(1, 4096, device=CUDA, dtype=torch.bfloat16)
    ref = x.float() @ quant_linear.dequantize_int4(layer).T
    first = layer(x)
    assert rel(first, ref) < 1e-2
    for _ in range(3):
        assert torch.equal(layer(x), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer(x)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, first)
    assert int(layer.split_counts.abs().sum()) == 0
