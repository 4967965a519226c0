"""The quantized formats themselves: e4m3 rounding as torch rounds, int4 packing, the
on-load quantizers, and what quantizing on load does to the default model's greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.worker.backends.paged_batches import PagedSequences
from worker.backends.numpy_backend import NumpyBackend
from worker.backends.numpy_decoder_ops import NumpyLinear
from worker.backends.torch_backend import TorchBackend
from worker.models.config import CheckpointError
from worker.models.loader import load_model
from worker.models.quantization import (
    E4M3_VALUES,
    INT4_GROUP_SIZE,
    Int4Weight,
    dequantize,
    pack_int4,
    quantize,
    quantize_fp8,
    quantize_int4,
    to_e4m3,
    unpack_int4,
)


def test_e4m3_table_and_rounding_match_torch() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(E4M3_VALUES, want)  # NaN where torch has NaN
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, s, 20000) for s in (1e-3, 0.1, 10.0, 200.0)]).astype(np.float32)
    x = np.concatenate([x, E4M3_VALUES[:126], (E4M3_VALUES[:125] + E4M3_VALUES[1:126]) / 2])  # exact, and ties
    torch_codes = torch.from_numpy(x).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(to_e4m3(x), torch_codes)


def test_int4_packing_round_trips_in_order() -> None:
    q = np.arange(-8, 8, dtype=np.int8).repeat(2).reshape(2, 16)
    packed = pack_int4(q)
    assert packed.shape == (2, 2) and packed.dtype == np.int32
    assert packed.view(np.uint32)[0, 0] == 0x33221100  # value j of word w is column 8w + j, stored q + 8
    np.testing.assert_array_equal(unpack_int4(packed), q)


def test_on_load_quantizers_bound_their_error() -> None:
    w = np.random.default_rng(1).normal(0, 0.05, (64, 256)).astype(np.float32)
    fp8 = quantize_fp8(w)
    assert fp8.scale.shape == (64,) and fp8.input_scale is None
    # e4m3 keeps 3 mantissa bits: half a step is at most 2^-4 of the value (normal range)
    big = np.abs(w) > 2**-6 * fp8.scale[:, None]
    assert np.all(np.abs(dequantize(fp8) - w)[big] <= np.abs(w)[big] * 2**-4 + 1e-12)
    for symmetric in (True, False):
        int4 = quantize_int4(w, 128, symmetric=symmetric)
        assert isinstance(int4, Int4Weight) and int4.scale.shape == (64, 2)
        assert (int4.zero is None) == symmetric
        step = np.repeat(int4.scale, 128, axis=1)
        assert np.all(np.abs(dequantize(int4) - w) <= step / 2 + 1e-7)
    with pytest.raises(ValueError, match="group size 128 does not divide the layer's 96 inputs"):
        quantize_int4(w[:, :96], 128)


def test_on_load_int4_is_asymmetric_groups_of_32_with_float_zeros() -> None:
    """Each group's min and max are grid points: a group's 16 levels span exactly its range,
    so 4-bit weights on such a grid (a GGUF Q4_1 block: w = d * q + m, q in 0..15) come back
    as they were; an integer zero point would shift them by up to half a step."""
    rng = np.random.default_rng(2)
    d = rng.uniform(1e-3, 1e-2, (48, 8, 1)).astype(np.float32)
    m = rng.uniform(-0.1, 0.0, (48, 8, 1)).astype(np.float32)
    q = rng.integers(0, 16, (48, 8, 32))
    q[:, :, :2] = [0, 15]  # the Q4_1 quantizer's d and m put a block's min and max at 0 and 15
    w = (d * q + m).reshape(48, 256)
    int4 = quantize(w, "int4")
    assert isinstance(int4, Int4Weight) and int4.group_size == INT4_GROUP_SIZE == 32
    assert int4.zero is not None and int4.zero.dtype == np.float32 and int4.scale.shape == (48, 8)
    np.testing.assert_allclose(dequantize(int4), w, rtol=0, atol=1e-6)
    integer_zero = Int4Weight(int4.packed, int4.scale, np.rint(int4.zero), 32)
    assert np.abs(dequantize(integer_zero) - w).max() > 1e-3
    with pytest.raises(ValueError, match="group size 12 is not a multiple of 8"):
        quantize_int4(w, 12)


def test_quantization_on_load_is_validated(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be one of fp8, int4, got 'int3'"):
        load_model(tiny_llama, quantization="int3")
    loaded = load_model(tiny_llama, quantization="int4")
    assert loaded.quantize == "int4" and loaded.quantization == "int4 (quantized on load, int4 RTN)"


def test_quantized_checkpoint_cannot_be_quantized_again(tmp_path: Path, tiny_llama: Path) -> None:
    import json
    import shutil

    shutil.copytree(tiny_llama, tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quant_method 'bitsandbytes'"):
        load_model(tmp_path / "q", quantization="fp8")


def test_both_cpu_backends_quantize_on_load_alike(tiny_llama: Path) -> None:
    """The numpy and torch-CPU backends compute with the same quantized reference."""
    prompt = [5, 17, 42, 99, 3, 250, 7, 8, 11]
    for mode in ("fp8", "int4"):
        loaded = load_model(tiny_llama, quantization=mode)
        logits = []
        backends: list[Any] = [NumpyBackend(loaded), TorchBackend(loaded, device="cpu")]
        for backend in backends:
            backend.allocate_kv_cache(num_blocks=16, block_size=4)
            batch = PagedSequences(num_blocks=16, block_size=4, seed=1).step([("s", prompt, 0, 9)], all_logits=True)
            logits.append(np.asarray(backend.logits_to_host(backend.forward(batch))))
        np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4, err_msg=mode)
        float_logits = NumpyBackend(load_model(tiny_llama))
        float_logits.allocate_kv_cache(num_blocks=16, block_size=4)
        batch = PagedSequences(num_blocks=16, block_size=4, seed=1).step([("s", prompt, 0, 9)], all_logits=True)
        assert not np.allclose(float_logits.forward(batch), logits[0], atol=1e-4), f"{mode} changed nothing"


def out_in(linear: Any) -> np.ndarray:
    """A CPU backend's linear weight as [out, in] (numpy holds it transposed)."""
    return linear.weight.T if isinstance(linear, NumpyLinear) else linear.weight.numpy()


def test_only_the_linear_projections_are_quantized(tiny_llama: Path) -> None:
    """The embedding (the lm head is tied to it) and the norms stay float; each of the
    seven projections carries its quantization's error, in both CPU backends."""
    floats = load_model(tiny_llama).weights
    embed = floats["model.embed_tokens.weight"]
    prefix = "model.layers.0."
    projections = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "o": ["self_attn.o_proj"],
                   "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}  # fmt: skip
    for mode in ("fp8", "int4"):
        loaded = load_model(tiny_llama, quantization=mode)
        for backend in (NumpyBackend(loaded), TorchBackend(loaded, device="cpu")):
            model, name = backend.model, f"{mode} {type(backend).__name__}"
            head = np.asarray(model.lm_head)
            assert loaded.config.tie_word_embeddings
            np.testing.assert_array_equal(head.T if isinstance(backend, NumpyBackend) else head, embed, err_msg=name)
            np.testing.assert_array_equal(np.asarray(model.embed), embed, err_msg=name)
            np.testing.assert_array_equal(np.asarray(model.final_norm), floats["model.norm.weight"], err_msg=name)
            layer = model.layers[0]
            for norm, key in ((layer.input_norm, "input_layernorm"), (layer.post_norm, "post_attention_layernorm")):
                np.testing.assert_array_equal(np.asarray(norm), floats[f"{prefix}{key}.weight"], err_msg=name)
            for role, names in projections.items():
                want = np.concatenate([floats[f"{prefix}{n}.weight"] for n in names])
                got = out_in(getattr(layer, role))
                assert got.shape == want.shape and not np.array_equal(got, want), (name, role)
                np.testing.assert_allclose(got, want, atol=0.1 * np.abs(want).max(), err_msg=f"{name} {role}")


# Next-token agreement of int4 (RTN) with the float default model over 20 prompts of 64 tokens:
# at each of the 20 x 64 positions, the argmax of the quantized model against the float one
# (teacher-forced on the prompt). Measured on SmolLM2-135M with prompts cut from README.md:
# 1.000 (1280 of 1280). That is not RTN being lossless: the default model is a GGUF Q4_1, 4-bit
# in blocks of 32 already, and on-load int4 (asymmetric, groups of 32, float zero points) finds
# the same grid and gives its weights back to float32 rounding. Requantized on any other grid
# it loses much (measured on the same prompts: symmetric group 64, the former scheme, 0.49;
# asymmetric group 64 0.64; group 32 with integer zero points 0.62). The floor is the goal.
INT4_AGREEMENT_FLOOR = 0.90


@pytest.mark.slow  # two forwards of 1280 tokens through the 135M default model on the CPU (~60 s)
def test_int4_on_load_agreement_with_the_default_model(default_model_dir: Path) -> None:
    loaded = load_model(default_model_dir, load_weights=False)
    ids = loaded.tokenizer.encode((Path(__file__).parents[3] / "README.md").read_text()).ids
    prompts = [ids[i * 97 : i * 97 + 64] for i in range(20)]
    assert all(len(p) == 64 for p in prompts)

    def argmaxes(quantization: str | None) -> np.ndarray:
        backend = TorchBackend(load_model(default_model_dir, quantization=quantization), device="cpu")
        backend.allocate_kv_cache(num_blocks=100, block_size=16)
        batch = PagedSequences(num_blocks=100, block_size=16, seed=1).step(
            [(str(i), p, 0, 64) for i, p in enumerate(prompts)], all_logits=True
        )
        return np.asarray(backend.logits_to_host(backend.forward(batch))).argmax(-1)

    same = argmaxes("int4") == argmaxes(None)
    agreement = float(same.mean())
    print(f"int4 on-load next-token agreement with the float model: {agreement:.4f} ({same.sum()} of {same.size})")
    assert agreement >= INT4_AGREEMENT_FLOOR
