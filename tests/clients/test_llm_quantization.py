"""LLM(model, quantization=...): the float checkpoint quantized as it loads, greedy tokens
as the backend alone computes them on the same quantized weights."""

from __future__ import annotations

from pathlib import Path

from clients.llm import LLM, SamplingParams
from tests.checkpoints import make_checkpoint
from tests.worker.backends.greedy_driver import greedy_run
from worker.backends.numpy_backend import NumpyBackend
from worker.executor import ExecutorConfig, KvCacheConfig
from worker.models.loader import load_model

CONFIG = ExecutorConfig(backend="numpy", kv_cache_config=KvCacheConfig(max_tokens=4096))


def test_llm_quantizes_on_load(tmp_path: Path) -> None:
    ckpt = make_checkpoint("llama_gqa", tmp_path / "llama")
    prompt = [5, 17, 42, 99, 3, 250, 7, 8, 11]
    backend = NumpyBackend(load_model(ckpt, quantization="int4"))
    backend.allocate_kv_cache(num_blocks=96, block_size=4)
    want = greedy_run(backend, {"p": prompt}, 10, seed=1)["p"]
    with LLM(ckpt, CONFIG, quantization="int4") as llm:
        core_backend = llm.executor.core.backend
        assert isinstance(core_backend, NumpyBackend)
        assert core_backend.quantization == "int4 (quantized on load, int4 RTN)"
        out = llm.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == want
