"""The executor on the real default model, SmolLM2-135M-Instruct (downloaded once, then cached)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clients.llm import LLM, SamplingParams
from tests.worker.executor.helpers import final_tokens, run_all
from worker.executor import Executor, ExecutorConfig, KvCacheConfig, Request
from worker.models.default_model import DefaultModelUnavailable, ensure_default_gguf

CONFIG = ExecutorConfig(backend="numpy", kv_cache_config=KvCacheConfig(max_tokens=8192))
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf() -> Path:
    try:
        return ensure_default_gguf()
    except DefaultModelUnavailable as e:
        pytest.skip(f"the default model cannot be fetched here: {e}")


def test_greedy_from_the_gguf_matches_transformers_loading_the_same_gguf(gguf: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt, list):  # transformers 5 returns a BatchEncoding here
        prompt = prompt["input_ids"]  # type: ignore[index]
    prompt = [int(t) for t in prompt]  # type: ignore[arg-type]
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    with Executor.from_model(gguf, CONFIG) as ex:
        (got,) = run_all(ex, [Request(input_token_ids=prompt, max_tokens=24, end_id=-1)]).values()
    assert final_tokens(got) == want


def test_chat_asking_for_the_capital_of_france_answers_paris(gguf: Path) -> None:
    with LLM(None, CONFIG) as llm:
        prompt = llm.apply_chat_template(QUESTION)
        out = llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0))[0].outputs[0]
    assert "Paris" in out.text, out.text
