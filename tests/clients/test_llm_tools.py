"""LLM.chat with tools, in process: the same tools, forced calls and parsers as the
service (protocol/chat_tools.py), on the tiny checkpoint."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from clients.llm import LLM
from tests.checkpoints import make_checkpoint
from tests.tool_schemas import ASK, LLAMA_CALL, PARAMS, WEATHER
from worker.executor import ExecutorConfig, KvCacheConfig

pytest.importorskip("xgrammar")

# A template that renders the tools and the turns that call or answer, as tool-calling templates do.
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>"
    "{% endfor %}"
    "</{{ m.role }}>\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    path: Path = make_checkpoint("llama_gqa", tmp_path_factory.mktemp("llm-tools") / "llama")
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "chat_template": TOOLS_TEMPLATE}))
    shutil.rmtree(path / "chat_template.jinja", ignore_errors=True)
    config = ExecutorConfig(backend="numpy", kv_cache_config=KvCacheConfig(max_tokens=2048))
    with LLM(path, config) as llm:
        yield llm


def test_a_forced_call_is_guided_to_its_schema(llm: LLM):
    out = llm.chat(ASK, tools=[WEATHER], tool_choice="get_weather", max_tokens=120, temperature=0.0)
    (call,) = out.outputs[0].tool_calls or []
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), PARAMS)
    assert out.text == ""


def test_a_call_the_model_writes_is_read_in_the_parsers_format(llm: LLM):
    out = llm.chat(ASK, tools=[WEATHER], tool_parser="llama3_json", guided_json=LLAMA_CALL, max_tokens=160,
                   temperature=0.0)  # fmt: skip
    (call,) = out.outputs[0].tool_calls or []
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), PARAMS)
    assert out.text == ""
    # Without tools the same format is text, and nothing is read as a call.
    plain = llm.chat(ASK, guided_json=LLAMA_CALL, max_tokens=160, temperature=0.0)
    assert plain.outputs[0].tool_calls is None
    assert json.loads(plain.text, strict=False)["name"] == "get_weather"


def test_the_tools_and_a_tool_result_are_in_the_prompt(llm: LLM):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}  # fmt: skip
    called: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
    messages: list[dict[str, Any]] = [*ASK, called, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = llm.chat(messages, tools=[WEATHER], tool_choice="auto", max_tokens=1, temperature=0.0)
    prompt = llm.tokenizer.decode(out.prompt_token_ids or [], skip_special_tokens=False)
    assert '<tools>[{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '<call>get_weather {"city": "Paris", "days": 1}</call>' in prompt  # the arguments as an object
    assert "<tool>sunny</tool>" in prompt
    none = llm.chat(messages, tools=[WEATHER], tool_choice="none", max_tokens=1, temperature=0.0)
    assert "<tools>" not in llm.tokenizer.decode(none.prompt_token_ids or [], skip_special_tokens=False)
    with pytest.raises(ValueError, match="tool_choice 'nope'"):
        llm.chat(ASK, tools=[WEATHER], tool_choice="nope", max_tokens=1)
