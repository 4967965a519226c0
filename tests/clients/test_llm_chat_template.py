"""LLM.apply_chat_template passes the template's own variables, as transformers does: a tiny
Qwen3 checkpoint whose template honours enable_thinking renders as transformers renders it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.llm import LLM
from tests.checkpoints import make_checkpoint
from worker.executor import ExecutorConfig, KvCacheConfig

# Qwen3's switch, cut down: thinking off leaves an empty think block for the model to skip.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Is 17 prime?"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_checkpoint("qwen3_head_dim", tmp_path_factory.mktemp("thinking") / "qwen3")
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "chat_template": THINKING_TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> Iterator[LLM]:
    config = ExecutorConfig(backend="numpy", kv_cache_config=KvCacheConfig(max_tokens=1024))
    with LLM(ckpt, config) as llm:
        yield llm


def test_enable_thinking_renders_as_transformers_renders_it(llm: LLM, ckpt: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ckpt)
    for thinking in (True, False):
        want = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        assert llm.apply_chat_template(MESSAGES, chat_template_kwargs={"enable_thinking": thinking}) == want
        assert llm.apply_chat_template(MESSAGES, enable_thinking=thinking) == want
    assert llm.apply_chat_template(MESSAGES) == hf.apply_chat_template(MESSAGES, tokenize=False,
                                                                       add_generation_prompt=True)  # fmt: skip
    off = llm.apply_chat_template(MESSAGES, chat_template_kwargs={"enable_thinking": False})
    assert off != llm.apply_chat_template(MESSAGES) and off.endswith("<think>\n\n</think>\n\n")


def test_thinking_off_prompt_generates(llm: LLM) -> None:
    prompt = llm.apply_chat_template(MESSAGES, chat_template_kwargs={"enable_thinking": False})
    [out] = llm.generate(prompt, max_tokens=4, ignore_eos=True)
    assert out.prompt_token_ids == llm.encode(prompt) and len(out.outputs[0].token_ids) == 4
