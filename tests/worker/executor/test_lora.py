"""LoRA adapters and prompt tuning through the engine: one batch mixing adapters and the
base model matches transformers + peft, the prefix cache never crosses adapters, slots
are evicted and reloaded without changing outputs, and every bad request fails alone."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.checkpoints import VOCAB_SIZE
from tests.worker.executor.helpers import final_tokens, run_all
from tests.worker.peft_adapters import make_adapter, peft_greedy
from worker.executor import (
    EngineCore,
    Executor,
    ExecutorConfig,
    KvCacheConfig,
    LoraConfig,
    OutputConfig,
    PeftCacheConfig,
    PromptTuningConfig,
    Request,
    Response,
)
from worker.models.config import CheckpointError

PROMPTS = [[7 + (5 * i + 3 * j) % 300 for j in range(21 + 3 * i)] for i in range(3)]


def config(backend: str = "numpy", **kw: object) -> ExecutorConfig:
    # 8 tokens a step: every prompt is computed in several chunks, mixed with other requests' decodes.
    return ExecutorConfig(backend=backend, max_num_tokens=8, kv_cache_config=KvCacheConfig(tokens_per_block=4,
                          max_tokens=2048), peft_cache_config=PeftCacheConfig(max_rank=8), **kw)  # type: ignore[arg-type]


def drive(core: EngineCore, requests: list[Request]) -> dict[int, list[Response]]:
    """Run requests (ids 0..n-1) on the core to the end; every response by request."""
    out: dict[int, list[Response]] = {i: [] for i in range(len(requests))}
    core.add_requests(enumerate(requests))
    while core.has_work:
        for r in core.step().all_responses():
            out[r.request_id].append(r)
    return out


def lora(name: str | None) -> LoraConfig | None:
    return None if name is None else LoraConfig(name)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_one_batch_mixing_two_adapters_and_none_matches_peft(
        tiny_llama: Path, lora_adapters: dict[str, Path], backend: str) -> None:
    names = ["a", "b", None]
    adapters = {name: str(path) for name, path in lora_adapters.items()}
    core = EngineCore.from_model(tiny_llama, config(backend, lora_adapters=adapters))
    assert core.lora_names() == ["a", "b"]
    wants = OutputConfig(return_generation_logits=True)
    requests = [Request(p, 6, end_id=-1, lora_config=lora(n), output_config=wants)
                for p, n in zip(PROMPTS, names, strict=True)]
    got = drive(core, requests)
    for i, name in enumerate(names):
        want, want_logits = peft_greedy(tiny_llama, None if name is None else lora_adapters[name], PROMPTS[i], 6)
        assert final_tokens(got[i]) == want, name
        logits = np.concatenate([np.asarray(r.result.generation_logits)[0] for r in got[i] if r.result is not None])
        np.testing.assert_allclose(logits, want_logits, atol=2e-3, rtol=1e-3)
    # The same batch on the ordinary path (sampled on the backend, overlapped) gives the same tokens.
    plain = drive(core, [replace(r, output_config=OutputConfig()) for r in requests])
    assert [final_tokens(plain[i]) for i in range(3)] == [final_tokens(got[i]) for i in range(3)]
    core.blocks.check_invariants([])


def test_prefix_cache_is_keyed_by_adapter(tiny_llama: Path, lora_adapters: dict[str, Path]) -> None:
    core = EngineCore(EngineCore.from_model(tiny_llama, config()).backend, config())
    for name, path in lora_adapters.items():
        core.register_lora(name, str(path))
    prompt = PROMPTS[2]  # 27 tokens: 6 full blocks of 4
    a_first = final_tokens(drive(core, [Request(prompt, 4, end_id=-1, lora_config=LoraConfig("a"))])[0])
    reused = core.blocks.reused_blocks
    b_tokens = final_tokens(drive(core, [Request(prompt, 4, end_id=-1, lora_config=LoraConfig("b"))])[0])
    base = final_tokens(drive(core, [Request(prompt, 4, end_id=-1)])[0])
    assert core.blocks.reused_blocks == reused, "blocks computed under adapter a were reused under b or none"
    assert b_tokens == peft_greedy(tiny_llama, lora_adapters["b"], prompt, 4)[0]
    assert base == peft_greedy(tiny_llama, None, prompt, 4)[0]
    a_again = final_tokens(drive(core, [Request(prompt, 4, end_id=-1, lora_config=LoraConfig("a"))])[0])
    assert core.blocks.reused_blocks == reused + 6  # the same adapter does reuse its own blocks
    assert a_again == a_first


def test_one_slot_two_adapters_alternating_evict_and_reload(tiny_llama: Path, lora_adapters: dict[str, Path]) -> None:
    """One device slot and one adapter in host memory: requests wait for the slot, adapters
    go back to disk and are read again on the loader thread; outputs do not change."""
    peft = PeftCacheConfig(max_device_adapters=1, max_host_adapters=1, max_rank=8)
    adapters = {name: str(path) for name, path in lora_adapters.items()}
    cfg = replace(config(), peft_cache_config=peft, lora_adapters=adapters,
                  kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=2048, enable_block_reuse=False))
    names = ["a", "b", "a", "b", None, "b"]
    with Executor(EngineCore.from_model(tiny_llama, cfg)) as executor:
        got = run_all(executor, [Request(PROMPTS[i % 3], 5, end_id=-1, lora_config=lora(n))
                                 for i, n in enumerate(names)])
    for (_, responses), (i, name) in zip(got.items(), enumerate(names), strict=True):
        want = peft_greedy(tiny_llama, None if name is None else lora_adapters[name], PROMPTS[i % 3], 5)[0]
        assert final_tokens(responses) == want, (i, name)


def test_an_unknown_adapter_fails_that_request_alone(tiny_llama: Path, lora_adapters: dict[str, Path]) -> None:
    core = EngineCore.from_model(tiny_llama, config(lora_adapters={"a": str(lora_adapters["a"])}))
    got = drive(core, [Request(PROMPTS[0], 3, end_id=-1, lora_config=LoraConfig("zzz")),
                       Request(PROMPTS[0], 3, end_id=-1, lora_config=LoraConfig("a"))])
    assert got[0][0].error_msg is not None and got[0][0].error_msg.startswith("unknown LoRA adapter 'zzz'")
    assert "held: a" in got[0][0].error_msg
    assert final_tokens(got[1]) == peft_greedy(tiny_llama, lora_adapters["a"], PROMPTS[0], 3)[0]
    off = EngineCore.from_model(tiny_llama, replace(config(), peft_cache_config=None))
    error = drive(off, [Request(PROMPTS[0], 3, lora_config=LoraConfig("a"))])[0][0].error_msg
    assert error is not None and error.startswith("unknown LoRA adapter 'a'") and "LoRA is off" in error


def test_bad_adapters_are_refused_at_registration_and_the_engine_keeps_serving(
        tiny_llama: Path, tiny_checkpoints: dict[str, Path], lora_adapters: dict[str, Path], tmp_path: Path) -> None:
    cfg = replace(config(), peft_cache_config=PeftCacheConfig(max_rank=4))
    with Executor(EngineCore.from_model(tiny_llama, cfg)) as executor:
        with pytest.raises(CheckpointError, match="rank 8 is above max_rank 4"):
            executor.register_lora("b", str(lora_adapters["b"]))
        head = make_adapter(tiny_checkpoints["llama_untied_llama3"], tmp_path / "head", 4, ["lm_head"], seed=5)
        with pytest.raises(CheckpointError, match="unsupported target module 'lm_head'"):
            executor.register_lora("head", str(head))
        executor.register_lora("a", str(lora_adapters["a"]))
        assert executor.lora_names() == ["a"]
        got = run_all(executor, [Request(PROMPTS[1], 3, end_id=-1, lora_config=LoraConfig("b")),
                                 Request(PROMPTS[1], 3, end_id=-1, lora_config=LoraConfig("a"))])
        first, second = got.values()
        assert first[0].error_msg is not None and first[0].error_msg.startswith("unknown LoRA adapter 'b'")
        assert final_tokens(second) == peft_greedy(tiny_llama, lora_adapters["a"], PROMPTS[1], 3)[0]
        executor.unregister_lora("a")
        assert executor.lora_names() == []
        (after,) = run_all(executor, [Request(PROMPTS[1], 3, lora_config=LoraConfig("a"))]).values()
        assert after[0].error_msg is not None and after[0].error_msg.startswith("unknown LoRA adapter 'a'")


def test_adapter_files_deleted_after_registration_fail_their_requests_alone(
        tiny_llama: Path, lora_adapters: dict[str, Path], tmp_path: Path) -> None:
    """An adapter dropped from host memory is read again from disk; if its files are gone,
    its requests get the loader's error and the others run."""
    copy = tmp_path / "b"
    copy.mkdir()
    for f in lora_adapters["b"].iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    cfg = replace(config(), peft_cache_config=PeftCacheConfig(max_host_adapters=1, max_rank=8))
    core = EngineCore.from_model(tiny_llama, cfg)
    core.register_lora("b", str(copy))
    core.register_lora("a", str(lora_adapters["a"]))  # pushes b out of host memory
    (copy / "adapter_model.safetensors").unlink()
    got = drive(core, [Request(PROMPTS[0], 3, end_id=-1, lora_config=LoraConfig("b")),
                       Request(PROMPTS[0], 3, end_id=-1, lora_config=LoraConfig("a"))])
    assert got[0][0].error_msg is not None and "adapter_model.safetensors is missing" in got[0][0].error_msg
    assert final_tokens(got[1]) == peft_greedy(tiny_llama, lora_adapters["a"], PROMPTS[0], 3)[0]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_prompt_table_rows_equal_to_vocabulary_embeddings_give_the_tokens_output(
        tiny_llama: Path, backend: str) -> None:
    embed = load_file(tiny_llama / "model.safetensors")["model.embed_tokens.weight"]
    prompt = PROMPTS[1]
    virtual = [5, 2, 7]  # positions given by table rows
    table = np.stack([embed[prompt[p]] for p in virtual])
    tuned = list(prompt)
    for row, p in enumerate(virtual):
        tuned[p] = VOCAB_SIZE + row
    core = EngineCore.from_model(tiny_llama, replace(config(backend), peft_cache_config=None))
    got = drive(core, [Request(prompt, 6, end_id=-1),
                       Request(tuned, 6, end_id=-1, prompt_tuning_config=PromptTuningConfig(table)),
                       # the same ids under another table must not reuse the blocks above
                       Request(tuned, 6, end_id=-1, prompt_tuning_config=PromptTuningConfig(table[::-1].copy()))])
    assert final_tokens(got[1]) == final_tokens(got[0])
    assert final_tokens(got[2]) != final_tokens(got[0])
    swapped = list(prompt)
    swapped[5], swapped[7] = prompt[7], prompt[5]  # what the reversed table spells
    assert final_tokens(got[2]) == final_tokens(drive(core, [Request(swapped, 6, end_id=-1)])[0])


def test_bad_prompt_tables_fail_their_request_alone(tiny_llama: Path) -> None:
    core = EngineCore.from_model(tiny_llama, replace(config(), peft_cache_config=None))
    hidden = core.model_config.hidden_size
    ok = Request([VOCAB_SIZE, 9, 10], 2, end_id=-1,
                 prompt_tuning_config=PromptTuningConfig(np.ones((2, hidden), np.float32)))
    got = drive(core, [
        replace(ok, prompt_tuning_config=PromptTuningConfig(np.ones((2, hidden + 1), np.float32))),
        replace(ok, input_token_ids=[VOCAB_SIZE + 2, 9]),
        replace(ok, prompt_tuning_config=None),
        ok,
    ])
    assert "embedding_table is 65 wide; the model's hidden size is 64" in (got[0][0].error_msg or "")
    assert f"token id {VOCAB_SIZE + 2} is outside the vocabulary and the prompt-tuning table" in (
        got[1][0].error_msg or "")
    assert f"token id {VOCAB_SIZE} is outside the vocabulary" in (got[2][0].error_msg or "")
    assert len(final_tokens(got[3])) == 2
