"""The service's chat template environment renders as transformers'
`apply_chat_template` does: for the default model and for a tiny checkpoint with
a template that uses what transformers provides (special tokens,
raise_exception, loop controls, tojson, the generation tag)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.chat_template import ChatTemplateError, render_chat
from tests.checkpoints import write_tokenizer
from tests.worker.conftest import default_gguf, default_model_dir

__all__ = ["default_gguf", "default_model_dir"]

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of Italy? «ünïcode» <b>&</b>"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "And Spain?"},
    ],
]

# Llama 2's template shape, with the parts of transformers' environment templates lean on.
OTHER_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system = false %}"
    "{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system %}"
    "{% set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{% generation %}{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endgeneration %}{% endif %}"
    "{% if loop.last %}{{ ' ' + {'n': loop.length, 'last': message['content']} | tojson }}{% break %}{% endif %}"
    "{% endfor %}"
)


def _compare(directory: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            got = render_chat(tok.chat_template, messages, add_generation_prompt=gen, bos_token=tok.bos_token,
                              eos_token=tok.eos_token)  # fmt: skip
            assert got == want


def test_default_model_template_matches_transformers(default_model_dir: Path):
    _compare(default_model_dir)  # asserts each rendering equals transformers'
    template = json.loads((default_model_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert "<|im_start|>" in render_chat(template, CONVERSATIONS[0])  # SmolLM2's ChatML turns


def test_another_template_matches_transformers(tmp_path: Path):
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": OTHER_TEMPLATE}))
    _compare(tmp_path)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(OTHER_TEMPLATE, [{"role": "assistant", "content": "first"}])


def test_no_template_and_the_sandbox():
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(None, CONVERSATIONS[0])
    with pytest.raises(ChatTemplateError, match=r"unsafe|not safely|access"):
        render_chat("{{ messages.__class__.__mro__ }}", CONVERSATIONS[0])
