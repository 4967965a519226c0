"""The torch backend's quantized weights, made on the CPU: the GPU's layouts (int4 packed
along the input, FP8 codes and scales) must stand for exactly the reference's values; and
the FP8 KV cache option, run by the torch-CPU path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.worker.backends.paged_batches import PagedSequences
from worker.backends import quant_linear
from worker.backends.torch_backend import TorchBackend
from worker.models.loader import load_model
from worker.models.quantization import (
    E4M3_VALUES,
    Fp8Weight,
    Int4Weight,
    dequantize,
    pack_int4,
    quantize_fp8,
    quantize_int4,
)

CPU = torch.device("cpu")


def weights(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.05, shape).astype(np.float32)


def test_int4_on_device_equals_the_reference() -> None:
    w = weights(96, 256)
    made = quant_linear.quantized_linear([torch.from_numpy(w[:32]), torch.from_numpy(w[32:])], None, "int4", CPU)
    assert isinstance(made, quant_linear.Int4Linear)
    assert made.qweight.shape == (256 // 8, 96) and made.qweight.dtype == torch.int32
    assert made.group_size == 32 and made.zero is not None  # on load: asymmetric groups of 32
    want = dequantize(quantize_int4(w))
    np.testing.assert_array_equal(quant_linear.dequantize_int4(made).numpy(), want)


def test_int4_checkpoint_parts_repacked_along_the_input() -> None:
    rng = np.random.default_rng(2)
    parts = []
    for rows, zero in ((16, True), (24, False)):
        q = rng.integers(-8, 8, (rows, 256)).astype(np.int8)
        z = rng.integers(-8, 8, (rows, 2)).astype(np.int8) if zero else None
        parts.append(Int4Weight(pack_int4(q), rng.random((rows, 2)).astype(np.float32), z, 128))
    made = quant_linear.quantized_linear(parts, None, None, CPU)
    assert isinstance(made, quant_linear.Int4Linear) and made.zero is not None
    want = np.concatenate([dequantize(p) for p in parts])
    np.testing.assert_array_equal(quant_linear.dequantize_int4(made).numpy(), want)


def test_fp8_on_device_equals_the_reference() -> None:
    w = weights(48, 64)
    made = quant_linear.quantized_linear([torch.from_numpy(w)], None, "fp8", CPU)
    assert isinstance(made, quant_linear.Fp8Linear) and made.input_scale is None
    ref = quantize_fp8(w)
    np.testing.assert_array_equal(made.weight.view(torch.uint8).numpy(), ref.codes)
    np.testing.assert_array_equal(made.scale[0].numpy(), ref.scale)


def test_fp8_checkpoint_parts_take_the_largest_static_scale() -> None:
    parts = [Fp8Weight(np.full((16, 32), 0x38, np.uint8), np.full(16, 0.5, np.float32), s) for s in (0.25, 2.0)]
    made = quant_linear.quantized_linear(parts, None, None, CPU)
    assert isinstance(made, quant_linear.Fp8Linear) and made.input_scale is not None
    assert made.input_scale.item() == 2.0 and made.scale.shape == (1, 32)
    assert float(E4M3_VALUES[0x38]) == 1.0 and torch.all(made.weight.float() == 1.0)


def test_fp8_reference_rounds_inputs_per_token() -> None:
    w = torch.eye(8)
    ref = quant_linear.Fp8Reference(w, None, None)
    x = torch.tensor([[1.0, 0.3, 0.0, 0, 0, 0, 0, 0], [100.0, 1.0, 0, 0, 0, 0, 0, 0]])
    y = ref(x)
    assert y[0, 0] == 1.0 and y[1, 0] == 100.0  # each row's amax is exact
    scale = 100.0 / 448.0  # 1.0 / scale = 4.48 -> e4m3 4.5
    assert torch.isclose(y[1, 1], torch.tensor(4.5 * scale))


def test_fp8_kv_cache_halves_the_bytes_and_stays_close(tiny_llama: Path) -> None:
    """The CPU twin of the kernels' e4m3 cache. Rounding K and V to e4m3 (3 mantissa bits:
    relative error <= 2^-4, rms ~3.6%) moves the tiny model's logits by a relative L2 of
    that order: measured 6.6%; bound 10%, and the greedy argmax mostly kept (11 of 12)."""
    loaded = load_model(tiny_llama)
    prompt = [5, 17, 42, 99, 3, 250, 7, 8, 11, 40, 41, 42]
    out = {}
    for kv in (None, "fp8"):
        backend = TorchBackend(loaded, device="cpu", kv_cache_dtype=kv)
        backend.allocate_kv_cache(num_blocks=16, block_size=4)
        out[kv] = np.asarray(backend.forward(PagedSequences(16, 4, seed=1).step([("s", prompt, 0, 12)], True)))
        if kv == "fp8":
            assert backend.ops.k_cache[0].dtype == torch.float8_e4m3fn
            assert backend.kv_bytes_per_token() * 4 == TorchBackend(loaded, device="cpu").kv_bytes_per_token()
    rel = np.linalg.norm(out["fp8"] - out[None]) / np.linalg.norm(out[None])
    assert 0 < rel < 0.1
    assert (out["fp8"].argmax(-1) == out[None].argmax(-1)).mean() >= 0.75
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'fp8' or None"):
        TorchBackend(loaded, device="cpu", kv_cache_dtype="int8")


_GEMV_CHECK = """
import numpy as np, torch
from worker.backends import quant_linear as ql, sm_count
from worker.models.quantization import Int4Weight, dequantize, pack_int4
sm_count.INTERPRETER_SMS = 2  # few SMs: the plan splits K, so the last-program reduction runs
# groups of 128 and 64: one per tile; of 32 (on load: float zeros) and 64: two or four per tile
cases = [(300, 512, None, 128), (256, 512, "int", 128), (96, 576, None, 64), (128, 1024, "int", 64),
         (264, 512, "float", 32), (96, 576, "float", 32)]
for n, k, zero, group in cases:
    rng = np.random.default_rng(n)
    z = None
    if zero == "int":
        z = rng.integers(-3, 3, (n, k // group)).astype(np.int8)
    elif zero == "float":
        z = rng.uniform(-3, 3, (n, k // group)).astype(np.float32)
    w = Int4Weight(pack_int4(rng.integers(-8, 8, (n, k)).astype(np.int8)),
                   (rng.random((n, k // group)) * 0.01).astype(np.float32), z, group)
    layer = ql.quantized_linear([w], None, None, torch.device("cpu"))
    x = torch.randn(1, k).to(torch.float16)
    ref = x.float() @ torch.from_numpy(dequantize(w)).T
    first = ql.w4a16_gemv(x, layer)
    assert float((first.float() - ref).norm() / ref.norm()) < 2e-3, (n, k, zero)
    assert torch.equal(ql.w4a16_gemv(x, layer), first)  # the counters left at zero; splits summed in order
    assert int(layer.split_counts.abs().sum()) == 0
print("ok")
"""


def test_batch_one_int4_kernel_in_the_triton_interpreter() -> None:
    """The CUDA batch-1 W4A16 kernel (one word load, nibbles unpacked in registers, split-K
    summed by the last program; tiles inside a group or holding several) run by Triton's
    CPU interpreter against the reference, integer and float zero points."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[3])}
    done = subprocess.run([sys.executable, "-c", _GEMV_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
