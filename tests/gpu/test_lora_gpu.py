"""LoRA adapters on the torch CUDA backend, CUDA graphs on: a batch mixing two adapters
and the base model decodes in graphs (each row's slot from the graph's static buffer,
padded rows with none) and gives the CPU reference's greedy tokens; in bfloat16 the
Triton kernel (lora_kernel.add_lora) runs, and graphs give the tokens eager steps give."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from tests.checkpoints import make_checkpoint
from worker.backends.torch_backend import TorchBackend
from worker.executor import EngineCore, ExecutorConfig, KvCacheConfig, LoraConfig, PeftCacheConfig, Request
from worker.models.config import ModelConfig
from worker.models.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_SHAPES = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "o_proj": "o", "gate_proj": "gate",
           "up_proj": "gate", "down_proj": "down"}  # fmt: skip


def write_adapter(checkpoint: Path, directory: Path, r: int, modules: list[str], seed: int) -> str:
    """A random adapter in the PEFT layout, written without peft (not on the GPU host)."""
    cfg = ModelConfig.from_hf(json.loads((checkpoint / "config.json").read_text()))
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    dims = {"q": (h, q), "kv": (h, kv), "o": (q, h), "gate": (h, i), "down": (i, h)}  # (in, out)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in modules:
            block = "self_attn" if module[0] in "qkvo" else "mlp"
            width, out = dims[_SHAPES[module]]
            name = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((r, width)) * 0.3).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (rng.standard_normal((out, r)) * 0.3).astype(np.float32)
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": modules, "bias": "none"}))
    return str(directory)


def _tokens(core: EngineCore, requests: list[Request]) -> list[list[int]]:
    tokens: list[list[int]] = [[] for _ in requests]
    core.add_requests(enumerate(requests))
    while core.has_work:
        for r in core.step().all_responses():
            assert r.result is not None, r.error_msg
            tokens[r.request_id] += r.result.output_token_ids[0]
    core.blocks.check_invariants([])
    return tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], list[Request]]:
    root = tmp_path_factory.mktemp("lora_gpu")
    model = make_checkpoint("llama_gqa", root / "llama")
    adapters = {"a": write_adapter(model, root / "a", 4, ["q_proj", "v_proj", "down_proj"], 1),
                "b": write_adapter(model, root / "b", 8, ["k_proj", "o_proj", "gate_proj", "up_proj"], 2)}
    names = ["a", "b", None, "a", "b", None, "b"]  # 7 rows: the bucket of 8 pads one
    prompts = [[7 + (5 * i + 3 * j) % 300 for j in range(9 + 4 * i)] for i in range(len(names))]
    requests = [Request(p, 24, end_id=-1, lora_config=None if n is None else LoraConfig(n))
                for p, n in zip(prompts, names, strict=True)]
    return model, adapters, requests


def _core(model: Path, adapters: dict[str, str], device: str, dtype: str, graphs: bool = True) -> EngineCore:
    cfg = ExecutorConfig(backend="torch", device=device, dtype=dtype, max_num_tokens=64, max_batch_size=16,
                         kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=8192),
                         peft_cache_config=PeftCacheConfig(max_device_adapters=2, max_rank=8), lora_adapters=adapters)
    backend = TorchBackend(load_model(model), device, dtype, max_num_tokens=64, max_graph_batch=16,
                           use_cuda_graphs=graphs)
    return EngineCore(backend, cfg)


def test_mixed_adapters_in_cuda_graphs_give_the_cpu_references_tokens(
        setup: tuple[Path, dict[str, str], list[Request]]) -> None:
    model, adapters, requests = setup
    want = _tokens(_core(model, adapters, "cpu", "float32"), requests)
    core = _core(model, adapters, "cuda", "float32")
    assert _tokens(core, requests) == want
    graphs = getattr(core.backend, "_graphs", None)
    assert graphs is not None and graphs.graphs, "no decode step ran in a graph"
    base = _tokens(_core(model, {}, "cpu", "float32"), [Request(r.input_token_ids, 24, end_id=-1) for r in requests])
    assert want[0] != base[0] and want[1] != base[1] and want[2] == base[2]  # the adapters do change the output


def test_the_triton_kernel_in_graphs_matches_eager_steps_in_bfloat16(
        setup: tuple[Path, dict[str, str], list[Request]]) -> None:
    model, adapters, requests = setup
    eager = _tokens(_core(model, adapters, "cuda", "bfloat16", graphs=False), requests)
    core = _core(model, adapters, "cuda", "bfloat16")
    assert _tokens(core, requests) == eager
    graphs = getattr(core.backend, "_graphs", None)
    assert graphs is not None and graphs.graphs
