"""Quantized checkpoints as users have them: compressed-tensors written by llm-compressor
(FP8_DYNAMIC, W4A16 symmetric and asymmetric) from a Llama, a Qwen3, a Gemma 3 and a Phi-3
(whose checkpoints hold q/k/v and gate/up fused, quantized as one matrix each), with transformers
loading the same files as the oracle; AWQ's gemm layout packed from its documented format; and bad checkpoints that
must fail at load naming the tensor.

Oracle tolerance. INT4 W4A16 is weight-only: transformers computes with the same float
weights, so greedy tokens must be identical. FP8_DYNAMIC also rounds each linear layer's
input to e4m3 per token at run time; our CPU reference does the same (as the GPU kernel
does), so the weights must equal transformers' exactly and the last-position logits agree
to 1e-3 of the logits' standard deviation (max abs difference / std) for most prompts:
measured ~1e-6, the float32 summation order. An activation that sits that close to an
e4m3 rounding midpoint rounds the other way on such a difference (a few in 10^5 do);
its prompt then moves by up to a few hundredths of the std, still under half the gap to
the float model the checkpoint came from (0.1-0.7 of the std), which the test asserts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.checkpoints import write_tokenizer
from tests.worker.backends.greedy_driver import greedy_run
from worker.backends.numpy_backend import NumpyBackend
from worker.backends.torch_backend import TorchBackend
from worker.models.config import CheckpointError
from worker.models.loader import load_model
from worker.models.quantization import Fp8Weight, Int4Weight, dequantize

PROMPTS = {"p": [5, 17, 42, 99, 3, 250, 7, 8, 11], "q": [9, 8, 7], "r": list(range(30, 52))}
SCHEMES = ("FP8_DYNAMIC", "W4A16", "W4A16_ASYM")
LOGIT_TOLERANCE = 1e-3  # of the logits' standard deviation (see above)


def tiny_model(family: str, directory: Path) -> Path:
    """A random model of `family` whose layers group size 128 divides (hidden 128,
    intermediate 256); Qwen3 and Gemma 3 with their per-head q/k norms, Gemma 2 with its
    soft-caps, at head_dim 32 (Gemma's local layers with a window shorter than the prompts)."""
    import transformers

    shape = {"vocab_size": 320, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
             "tie_word_embeddings": False, "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2,
             "pad_token_id": 0}  # fmt: skip
    classes: dict[str, Any] = {
        "llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config,
        "gemma2": transformers.Gemma2Config, "gemma3_text": transformers.Gemma3TextConfig,
        "phi3": transformers.Phi3Config,
    }  # fmt: skip
    extra = {"head_dim": 32, "sliding_window": 6} if family.startswith("gemma") else {}
    config = classes[family](**shape, **extra)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    write_tokenizer(directory)
    return directory


# Quantized projections per layer: q, k, v, o, gate, up, down (Phi-3's qkv and gate_up are one each).
PROJECTIONS = {"llama": 7, "qwen3": 7, "gemma2": 7, "gemma3_text": 7, "phi3": 4}


@pytest.fixture(scope="module", params=list(PROJECTIONS))
def checkpoints(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """scheme -> a checkpoint llm-compressor wrote from the same float model ("float" too)."""
    pytest.importorskip("llmcompressor", reason="llm-compressor is in the test extra (pip install -e '.[test]')")
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp(f"quantized_{request.param}")
    out = {"float": tiny_model(request.param, root / "float")}
    for scheme in SCHEMES:
        model = AutoModelForCausalLM.from_pretrained(out["float"], dtype=torch.float32)
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
        oneshot(model=model, recipe=recipe, output_dir=str(root / scheme))
        write_tokenizer(root / scheme)
        out[scheme] = root / scheme
    return out


def hf_model(directory: Path) -> Any:
    from transformers import AutoModelForCausalLM

    # eager: transformers' SDPA path drops Gemma 2's attention soft-cap; eager is its reference.
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")


def hf_greedy(model: Any, n: int) -> dict[str, list[int]]:
    with torch.no_grad():
        return {
            s: model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None)[
                0, len(p) :
            ].tolist()
            for s, p in PROMPTS.items()
        }


def last_logits(backend: Any, prompt: list[int]) -> np.ndarray:
    from tests.worker.backends.paged_batches import PagedSequences

    batch = PagedSequences(num_blocks=96, block_size=4, seed=1).step([("s", prompt, 0, len(prompt))], all_logits=False)
    return np.asarray(backend.logits_to_host(backend.forward(batch)))[-1]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_loader_reads_the_scheme(scheme: str, checkpoints: dict[str, Path]) -> None:
    loaded = load_model(checkpoints[scheme])
    assert loaded.quantization is not None and loaded.quantization.startswith("compressed-tensors")
    assert len(loaded.quantized) == 2 * PROJECTIONS[loaded.config.model_type]  # every projection, not the lm head
    kind = Fp8Weight if scheme.startswith("FP8") else Int4Weight
    assert all(isinstance(w, kind) for w in loaded.quantized.values())
    assert "model.layers.0.self_attn.o_proj.weight" not in loaded.weights
    assert "lm_head.weight" in loaded.weights
    if scheme == "W4A16_ASYM":
        w = loaded.quantized["model.layers.1.mlp.down_proj.weight"]
        assert isinstance(w, Int4Weight) and w.zero is not None and w.zero.any()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dequantized_weights_equal_transformers(scheme: str, checkpoints: dict[str, Path]) -> None:
    hf = hf_model(checkpoints[scheme])
    loaded = load_model(checkpoints[scheme])
    for name, w in loaded.quantized.items():
        module = hf.get_submodule(name.removesuffix(".weight"))
        np.testing.assert_array_equal(dequantize(w), hf_weight(module).detach().numpy(), err_msg=name)


def hf_weight(module: Any) -> torch.Tensor:
    """The float weight transformers computes with, by compressed-tensors' own functions
    where the module stayed compressed."""
    if hasattr(module, "weight_packed"):  # int4, compressed
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
        from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

        args = module.quantization_scheme.weights
        shape = torch.Size(module.weight_shape.tolist())
        zero = None
        if not args.symmetric:
            zero = unpack_from_int32(module.weight_zero_point, 4, (shape[0], module.weight_scale.shape[-1]), 0)
        q = unpack_from_int32(module.weight_packed, 4, shape)
        return ct_dequantize(x_q=q, scale=module.weight_scale, zero_point=zero, args=args)
    if module.weight.dtype == torch.float8_e4m3fn:  # fp8, symmetric: e4m3 value * scale
        return module.weight.float() * module.weight_scale.float()
    return module.weight  # decompressed at load


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM"])
def test_int4_greedy_identical_to_transformers(scheme: str, checkpoints: dict[str, Path]) -> None:
    want = hf_greedy(hf_model(checkpoints[scheme]), 12)
    loaded = load_model(checkpoints[scheme])
    for backend in (NumpyBackend(loaded), TorchBackend(loaded, device="cpu")):
        backend.allocate_kv_cache(num_blocks=96, block_size=4)
        assert greedy_run(backend, PROMPTS, 12, seed=5) == want, backend.name


def test_fp8_logits_within_tolerance_of_transformers(checkpoints: dict[str, Path]) -> None:
    hf = hf_model(checkpoints["FP8_DYNAMIC"])
    other = hf_model(checkpoints["float"])
    loaded = load_model(checkpoints["FP8_DYNAMIC"])
    for backend in (NumpyBackend(loaded), TorchBackend(loaded, device="cpu")):
        backend.allocate_kv_cache(num_blocks=96, block_size=4)
        gaps, float_gaps = [], []
        for prompt in PROMPTS.values():
            with torch.no_grad():
                want = hf(torch.tensor([prompt])).logits[0, -1].numpy()
                unquantized = other(torch.tensor([prompt])).logits[0, -1].numpy()
            spread = float(want.std())
            gaps.append(float(np.abs(last_logits(backend, prompt) - want).max()) / spread)
            float_gaps.append(float(np.abs(unquantized - want).max()) / spread)
        # Most prompts agree to the float32 summation order; where an activation's e4m3
        # rounding flips on such a difference, that prompt moves further, but never as far
        # as leaving the quantization out moves it.
        assert sorted(gaps)[len(gaps) // 2] < LOGIT_TOLERANCE, (backend.name, gaps)
        assert all(g < f / 2 for g, f in zip(gaps, float_gaps, strict=True)), (backend.name, gaps, float_gaps)
        assert min(float_gaps) > LOGIT_TOLERANCE  # the tolerance separates the checkpoint from its float model


# -- AWQ ------------------------------------------------------------------------------------

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack order: nibble i of a word holds column 8w + AWQ_ORDER[i]


def awq_pack(values: np.ndarray) -> np.ndarray:
    """Unsigned 4-bit [rows, cols] -> int32 [rows, cols // 8] as AutoAWQ's WQLinear_GEMM packs."""
    packed = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
    for col in range(values.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + AWQ_ORDER[i]].astype(np.uint32) << (4 * i)
    return packed.view(np.int32)


def write_awq(float_dir: Path, out: Path, group: int = 128) -> dict[str, np.ndarray]:
    """The float checkpoint quantized AWQ-style (asymmetric min/max per group, zero points)
    and written in the gemm layout; returns each layer's quantized values as floats."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(float_dir, out)
    (out / "model.safetensors").unlink()
    tensors = load_file(str(float_dir / "model.safetensors"))
    expected, written = {}, {}
    for name, w in tensors.items():
        if not (name.endswith("_proj.weight") and ".layers." in name):
            written[name] = w
            continue
        n_out, n_in = w.shape
        g = w.reshape(n_out, n_in // group, group)
        lo, hi = g.min(axis=2), g.max(axis=2)
        scale = ((hi - lo) / 15).astype(np.float16)
        zero = np.clip(np.rint(-lo / scale.astype(np.float32)), 0, 15)
        q = np.clip(np.rint(g / scale[:, :, None].astype(np.float32)) + zero[:, :, None], 0, 15)
        expected[name] = ((q - zero[:, :, None]) * scale[:, :, None].astype(np.float32)).reshape(n_out, n_in)
        base = name.removesuffix("weight")
        written[base + "qweight"] = awq_pack(q.reshape(n_out, n_in).T.astype(np.int64))  # [in, out // 8]
        written[base + "qzeros"] = awq_pack(zero.T.astype(np.int64))  # [groups, out // 8]
        written[base + "scales"] = np.ascontiguousarray(scale.T)  # [groups, out]
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                  "version": "gemm"}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg))
    return expected


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model("llama", tmp_path_factory.mktemp("float") / "llama")


def test_awq_dequantizes_to_the_quantized_values_exactly(float_llama: Path, tmp_path: Path) -> None:
    expected = write_awq(float_llama, tmp_path / "awq")
    loaded = load_model(tmp_path / "awq")
    assert loaded.quantization == "awq gemm (int4 group 128)"
    assert loaded.quantized.keys() == expected.keys()
    for name, values in expected.items():
        np.testing.assert_array_equal(dequantize(loaded.quantized[name]), values, err_msg=name)
    # and the model runs on them: both CPU backends, the same tokens
    runs = []
    for backend in (NumpyBackend(loaded), TorchBackend(loaded, device="cpu")):
        backend.allocate_kv_cache(num_blocks=96, block_size=4)
        runs.append(greedy_run(backend, PROMPTS, 8, seed=5))
    assert runs[0] == runs[1]


# -- bad checkpoints ------------------------------------------------------------------------


def _edit(directory: Path, out: Path, tensors: dict[str, Any] | None = None, config: dict[str, Any] | None = None
          ) -> Path:  # fmt: skip
    from safetensors.torch import load_file, save_file

    shutil.copytree(directory, out)
    if tensors:
        weights = load_file(str(out / "model.safetensors"))
        weights.update(tensors)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    if config:
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"].update(config)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_wrong_scale_shape_names_the_tensor(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    name = "model.layers.1.mlp.down_proj.weight_scale"
    bad = _edit(checkpoints["FP8_DYNAMIC"], tmp_path / "bad", tensors={name: torch.ones(3, 1)})
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \(3, 1\)"):
        load_model(bad)


def test_int4_scale_shape_names_the_tensor(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    bad = _edit(checkpoints["W4A16"], tmp_path / "bad", tensors={name: torch.ones(128, 2)})
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \(128, 2\)"):
        load_model(bad)


def test_group_size_not_dividing_the_layer_names_the_tensor(float_llama: Path, tmp_path: Path) -> None:
    write_awq(float_llama, tmp_path / "awq", group=64)
    cfg = json.loads((tmp_path / "awq" / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 96  # 128 inputs are not groups of 96
    (tmp_path / "awq" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match=r"'model\.layers\.0\.self_attn\.q_proj\.qweight': group size 96 does not"
    ):
        load_model(tmp_path / "awq")


def test_unsupported_quant_method_names_it_and_a_layer(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    bad = _edit(checkpoints["W4A16"], tmp_path / "bad", config={"quant_method": "gptq"})
    with pytest.raises(CheckpointError, match=r"quant_method 'gptq' \(layer model\.layers\.0\.mlp\.down_proj\)"):
        load_model(bad)


def test_unsupported_scheme_names_it(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    cfg = json.loads((checkpoints["W4A16"] / "config.json").read_text())
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    group["weights"]["num_bits"] = 8  # W8A16 int8: not a scheme tokenwire runs
    bad = _edit(checkpoints["W4A16"], tmp_path / "bad", config={"config_groups": {"group_0": group}})
    with pytest.raises(CheckpointError, match=r"weights int 8-bit group .*\(layer model\.layers\.0\.mlp\.down_proj\)"):
        load_model(bad)
