"""gateway.openai_api: OpenAI's request bodies become the Submit the gateway routes,
each parameter where tokenwire keeps it; bad ones are a 400 naming the field."""

from __future__ import annotations

import json
import re

import pytest
from pydantic import ValidationError

from gateway import openai_api as api


def test_every_chat_parameter_reaches_the_submit() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = api.ChatRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "n": 2, "stop": "!", "seed": 3,
        "logprobs": True, "top_logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": 0.25, "user": "u",
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True,
    })  # fmt: skip
    submit = api.submit_for(body, "chatcmpl-1", "m", None, 2048)
    s = submit.sampling_config
    assert (submit.max_tokens, submit.num_return_sequences, submit.stop) == (7, 2, ["!"])
    assert (s.temperature, s.top_p, s.seed, s.top_k, s.min_p) == (0.5, 0.9, 3, 5, 0.1)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, 0.25, 1.2)
    assert submit.output_config.return_log_probs and submit.output_config.top_n_log_probs == 2
    assert submit.end_id == -1
    assert submit.guided_decoding_params is not None
    assert json.loads(submit.guided_decoding_params.guide or "") == schema
    assert [m.content for m in submit.messages or []] == ["hi"]  # rendered by the gateway, not here


def test_completion_defaults_and_json_object() -> None:
    body = api.CompletionRequest.model_validate({"model": "m", "prompt": [[5, 6, 7]], "logprobs": 0})
    submit = api.submit_for(body, "cmpl-1", "m", None, 2048)
    assert submit.input_token_ids == [5, 6, 7] and submit.max_tokens == 16  # OpenAI's default
    assert submit.sampling_config.temperature == 1.0  # OpenAI's default: sampled, not greedy
    assert submit.output_config.return_log_probs and submit.output_config.top_n_log_probs == 0
    chat = api.ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                           "response_format": {"type": "json_object"}})  # fmt: skip
    submit = api.submit_for(chat, "chatcmpl-2", "m", [1, 2, 3], 100)
    assert submit.max_tokens == 97  # a chat may fill the context
    assert submit.sampling_config.temperature == 1.0
    greedy = api.ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "temperature": 0})
    assert api.submit_for(greedy, "chatcmpl-3", "m", [1], 100).sampling_config.temperature == 0.0
    assert submit.guided_decoding_params is not None and submit.guided_decoding_params.guide_type == "json"


def test_logit_bias_becomes_the_embedding_bias_over_the_vocabulary() -> None:
    body = api.CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"3": 100, "5": -100}})
    submit = api.submit_for(body, "cmpl-1", "m", None, 2048, vocab_size=8)
    assert submit.embedding_bias == [0, 0, 0, 100, 0, -100, 0, 0]
    assert api.submit_for(api.CompletionRequest.model_validate({"prompt": "x"}), "cmpl-2", "m", None, 2048,
                          vocab_size=8).embedding_bias is None  # fmt: skip
    for bias, vocab, problem in [({"9": 1}, 8, "token id 9 is outside the vocabulary (size 8)"),
                                 ({"x": 1}, 8, "keys are token ids, got 'x'"),
                                 ({"1": 1}, None, "vocabulary is not known yet")]:  # fmt: skip
        bad = api.CompletionRequest.model_validate({"prompt": "x", "logit_bias": bias})
        with pytest.raises(ValueError, match=re.escape(problem)):
            api.submit_for(bad, "cmpl-3", "m", None, 2048, vocab_size=vocab)
    with pytest.raises(ValidationError, match="logit_bias"):
        api.CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"1": 101}})


def test_a_list_of_prompts_is_a_request_for_each() -> None:
    body = api.CompletionRequest.model_validate({"prompt": ["a", "b"], "n": 2, "max_tokens": 3})
    parts = body.each_prompt()
    assert [p.prompt for p in parts] == ["a", "b"]
    assert all((p.n, p.max_tokens) == (2, 3) for p in parts)
    ids = api.CompletionRequest.model_validate({"prompt": [[5, 6], [7]]}).each_prompt()
    assert [api.submit_for(p, "cmpl-1", "m", None, 2048).input_token_ids for p in ids] == [[5, 6], [7]]
    (one,) = api.CompletionRequest.model_validate({"prompt": [[7, 8]]}).each_prompt()
    assert one.prompt == [7, 8]  # a list of one prompt is that prompt


@pytest.mark.parametrize(("raw", "param"), [
    ({"prompt": "x", "temperature": 3}, "temperature"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "", "max_tokens": 4}, None),
    ({"prompt": "x", "no_such_option": 1}, "no_such_option"),
    ({"prompt": ["a", "b"], "stream": True}, None),
    ({"prompt": ["a"] * (api.MAX_PROMPTS + 1)}, None),
    ({"prompt": ["a", ""]}, None),
])  # fmt: skip
def test_bad_parameters_are_400s_naming_the_field(raw: dict[str, object], param: str | None) -> None:
    try:
        body = api.CompletionRequest.model_validate(raw)
        api.submit_for(body, "cmpl-1", "m", None, 2048)
    except (ValidationError, ValueError) as e:
        error = api.invalid(e)
    except api.ApiError as e:
        error = e
    else:
        raise AssertionError(f"{raw} was accepted")
    assert error.status == 400 and error.type == "invalid_request_error"
    if param is not None:
        assert error.param == param and param in error.message
    else:
        assert "prompt" in error.message or "no_such_option" in error.message
    assert not error.message.startswith("Value error"), "pydantic's wording for a validator's ValueError"


# As Qwen 2.5's and Hermes' templates render tools, calls and results (abridged).
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{% if m.role == 'tool' %} for {{ m.tool_call_id }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if enable_thinking is false %}<think></think>{% endif %}"
)


def test_tools_calls_and_results_reach_the_chat_template() -> None:
    from protocol.chat_template import render_chat

    body = api.ChatRequest.model_validate({
        "messages": [{"role": "user", "content": "weather?"},
                     {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        "chat_template_kwargs": {"enable_thinking": False},
    })  # fmt: skip
    text = render_chat(TOOL_TEMPLATE, body.template_messages(), extra=body.template_extra())
    assert '<tools>{"name": "get_weather", "parameters": {"type": "object"}}</tools>' in text
    # The arguments reach the template as an object (OpenAI sends them as JSON text).
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\nsunny for call_1<|im_end|>" in text
    assert text.endswith("<think></think>")
    none = body.model_copy(update={"tool_choice": "none"})
    assert "<tools>" not in render_chat(TOOL_TEMPLATE, none.template_messages(), extra=none.template_extra())
    with pytest.raises(ValueError, match="not JSON"):
        api.ChatRequest.model_validate({"messages": [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}).template_messages()
