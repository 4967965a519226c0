"""A gpt-oss checkpoint with its experts in MXFP4, as published (`*_blocks`, `*_scales`,
quant_method "mxfp4"), loads with the experts kept packed (the CPU backends dequantize
them as they build each layer) and gives transformers' greedy tokens for the float
checkpoint holding exactly the values the MXFP4 codes stand for."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.worker.backends.greedy_driver import greedy_run
from tests.worker.models.mxfp4_checkpoints import mxfp4_and_float_twins
from worker.backends.numpy_backend import NumpyBackend
from worker.backends.torch_backend import TorchBackend
from worker.models.loader import load_model
from worker.models.mxfp4_checkpoint import Mxfp4File

PROMPTS = {"p": [5, 17, 42, 99, 3, 250, 7, 8, 11], "q": list(range(30, 52))}


def test_mxfp4_experts_give_transformers_tokens_of_their_values(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    packed, exact = mxfp4_and_float_twins(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(exact, dtype=torch.float32, attn_implementation="eager").eval()
    want = {}
    with torch.no_grad():
        for s, p in PROMPTS.items():
            want[s] = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None)[0, len(p):]
    loaded = load_model(packed)
    assert loaded.quantization == "mxfp4 experts"
    experts = loaded.mxfp4_experts
    assert len(experts) == 2 * loaded.config.num_layers  # gate_up_proj and down_proj of every layer
    assert all(isinstance(f, Mxfp4File) and name not in loaded.weights for name, f in experts.items())
    # and as the CUDA backend reads a checkpoint: each tensor from its file as the model is built
    from_files = load_model(packed, load_weights=False)
    assert not from_files.weights and from_files.mxfp4_experts.keys() == experts.keys()
    for backend in (NumpyBackend(loaded), TorchBackend(loaded, device="cpu", max_model_len=64),
                    TorchBackend(from_files, device="cpu", max_model_len=64)):  # fmt: skip
        backend.allocate_kv_cache(num_blocks=96, block_size=4)
        assert greedy_run(backend, PROMPTS, 8, seed=5) == {s: t.tolist() for s, t in want.items()}, backend.name
