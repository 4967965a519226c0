"""LoRA adapters over tensor-parallel ranks and pipeline stages (gloo, on the CPU): each
rank holds its shard of its stage's layers of every slot. A batch mixing two adapters
of different ranks and targets with the base model gives one process's greedy tokens
(and transformers + peft's), generation logits within 1e-4 of one process's; adapters
registered at run time and evicted from a single device slot give the same tokens."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import pytest

from tests.worker.executor.helpers import final_tokens, run_all
from tests.worker.parallel.executors import parallel_executor
from tests.worker.peft_adapters import make_adapter, peft_greedy
from worker.executor import (
    Executor,
    LoraConfig,
    OutputConfig,
    PeftCacheConfig,
    Request,
    SamplingConfig,
)

PROMPTS = [[7 + (5 * i + 3 * j) % 300 for j in range(21 + 3 * i)] for i in range(3)]
NAMES = ["a", "b", None]


def _lora(name: str | None) -> LoraConfig | None:
    return None if name is None else LoraConfig(name)


@pytest.fixture(scope="module")
def mqa_adapters(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters of the one-KV-head Qwen2 (with qkv biases): k and v are copied on every rank."""
    model, root = tiny_checkpoints["qwen2_mqa"], tmp_path_factory.mktemp("mqa_adapters")
    return {
        "a": make_adapter(model, root / "a", 4, ["k_proj", "v_proj", "o_proj", "down_proj"], seed=3),
        "b": make_adapter(model, root / "b", 8, ["q_proj", "gate_proj", "up_proj"], seed=4),
    }


def executor(model: Path, adapters: dict[str, Path], tp: int, pp: int = 1,
             peft: PeftCacheConfig | None = None) -> AbstractContextManager[Executor]:  # fmt: skip
    # 8 tokens a step: every prompt is computed in chunks, beside the others' decodes.
    return parallel_executor(model, tp, pp, max_num_tokens=8, peft_cache_config=peft or PeftCacheConfig(max_rank=8),
                             lora_adapters={name: str(path) for name, path in adapters.items()})  # fmt: skip


def _mixed_batch(model: Path, adapters: dict[str, Path], tp: int, pp: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """Each prompt's greedy tokens under a, b and no adapter, in one batch, and their logits."""
    wants = OutputConfig(return_generation_logits=True)
    greedy = SamplingConfig(temperature=0.0)
    requests = [Request(p, 6, end_id=-1, sampling_config=greedy, output_config=wants, lora_config=_lora(n))
                for p, n in zip(PROMPTS, NAMES, strict=True)]  # fmt: skip
    with executor(model, adapters, tp, pp) as ex:
        got = list(run_all(ex, requests).values())
    logits = [np.concatenate([np.asarray(r.result.generation_logits)[0] for r in g if r.result is not None])
              for g in got]  # fmt: skip
    return [final_tokens(g) for g in got], logits


@pytest.mark.parametrize(
    ("name", "tp", "pp"),
    [
        ("llama_gqa", 2, 1),
        ("qwen2_mqa", 2, 1),  # one KV head on two ranks
        ("llama_gqa", 1, 2),
        ("qwen2_mqa", 2, 2),  # and two stages of it
    ],
)
def test_a_batch_mixing_adapters_and_none_equals_one_process_and_peft(
        name: str, tp: int, pp: int, tiny_checkpoints: dict[str, Path], lora_adapters: dict[str, Path],
        mqa_adapters: dict[str, Path]) -> None:  # fmt: skip
    model = tiny_checkpoints[name]
    adapters = mqa_adapters if name == "qwen2_mqa" else lora_adapters
    tokens, logits = _mixed_batch(model, adapters, tp, pp)
    want_tokens, want_logits = _mixed_batch(model, adapters, 1, 1)
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    for prompt, adapter, got_tokens in zip(PROMPTS, NAMES, tokens, strict=True):
        assert got_tokens == peft_greedy(model, None if adapter is None else adapters[adapter], prompt, 6)[0], adapter
    # The adapters change the outputs: otherwise the comparisons above say nothing about them.
    assert len({tuple(t) for t in tokens}) == 3


def test_adapters_registered_at_run_time_and_evicted_from_one_slot_under_tp(
        tiny_llama: Path, lora_adapters: dict[str, Path]) -> None:
    """One device slot, one host copy: each adapter's load rewrites the slot's shard on
    every rank between steps; the one evicted from the host is read from disk again."""
    names: list[str | None] = ["a", "b", "a", None, "b"]
    peft = PeftCacheConfig(max_device_adapters=1, max_host_adapters=1, max_rank=8)
    with executor(tiny_llama, {}, 2, peft=peft) as ex:
        assert ex.lora_names() == []
        for adapter, path in lora_adapters.items():
            ex.register_lora(adapter, str(path))
        got = run_all(ex, [Request(PROMPTS[i % 3], 5, end_id=-1, lora_config=_lora(n))
                           for i, n in enumerate(names)])  # fmt: skip
        ex.unregister_lora("a")
        assert ex.lora_names() == ["b"]
    for (i, name), responses in zip(enumerate(names), got.values(), strict=True):
        want = peft_greedy(tiny_llama, None if name is None else lora_adapters[name], PROMPTS[i % 3], 5)[0]
        assert final_tokens(responses) == want, (i, name)
