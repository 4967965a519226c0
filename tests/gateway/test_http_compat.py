"""What OpenAI's applications send beyond the basic calls, through the official
`openai` SDK against a real gateway and worker (processes, Redis, the tiny
checkpoint): fields that change nothing here, errors in OpenAI's shape on every
route, echo and prompt log probs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.gateway.http_service import http_service

openai = pytest.importorskip("openai")

MODEL = "tiny-llama-long"


@pytest.fixture(scope="module")
def service(long_model, redis_server, tmp_path_factory):
    with http_service(long_model, redis_server.url, tmp_path_factory.mktemp("compat")) as s:
        yield s


@pytest.fixture(scope="module")
def client(service):
    with openai.OpenAI(base_url=f"{service.http_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_fields_that_change_nothing_are_accepted(client):
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0.0)
    ignored = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0.0,
                                             store=False, metadata={"app": "test"}, user="someone",
                                             service_tier="auto", reasoning_effort="low")  # fmt: skip
    assert ignored.choices[0].message.content == plain.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, user="someone",
                                     extra_body={"metadata": {"a": "b"}})  # fmt: skip
    assert comp.choices[0].text is not None


def test_unknown_parameter_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body={"frobnicate": 1})  # fmt: skip
    assert e.value.body["param"] == "frobnicate"
    assert "frobnicate" in e.value.body["message"]


def test_unknown_routes_and_methods_answer_in_openais_shape(client):
    with pytest.raises(openai.NotFoundError) as e404:
        client.get("/no/such/route", cast_to=object)
    assert e404.value.body["type"] == "not_found_error"
    assert "/v1/no/such/route" in e404.value.body["message"]
    with pytest.raises(openai.APIStatusError) as e405:
        client.get("/completions", cast_to=object)
    assert e405.value.status_code == 405
    assert e405.value.body["type"] == "invalid_request_error"
    assert "GET" in e405.value.body["message"]


def hf_prompt_log_probs(checkpoint, tokens: list[int]):
    """transformers' log prob of each token after the first, and each position's log-softmax row."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), dim=-1).numpy()
    return [float(rows[i, t]) for i, t in enumerate(tokens[1:])], rows


# float32 forward passes of two implementations differ by ~1e-5 in the logits.
TOL = 1e-4


def test_echo_with_logprobs_scores_the_prompt(client, long_model):
    prompt = [5, 17, 93, 42, 7, 130, 61, 8]
    want, rows = hf_prompt_log_probs(long_model, prompt)
    # max_tokens 0: the prompt alone.
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0.0)
    (choice,) = r.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=TOL)
    for position, top in enumerate(lp.top_logprobs[1:]):
        assert len(top) <= 2  # two tokens, unless they decode alike
        assert max(top.values()) == pytest.approx(rows[position].max(), abs=TOL)
    assert choice.text == "".join(lp.tokens)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(prompt)
    # lm-evaluation-harness: max_tokens 1, an entry for every prompt token and the one generated.
    r1 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0.0)
    lp1 = r1.choices[0].logprobs
    assert len(lp1.token_logprobs) == len(prompt) + 1
    assert lp1.token_logprobs[1:-1] == pytest.approx(want, abs=TOL)
    assert lp1.token_logprobs[-1] == pytest.approx(rows[-1].max(), abs=TOL)  # greedy: the likeliest
    assert r1.choices[0].text.startswith(choice.text)


def test_echo_keeps_an_end_of_sequence_token(client, long_model):
    eos = json.loads((long_model / "config.json").read_text())["eos_token_id"]  # the model's, which ends a request
    prompt = [5, 17, 93]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0.0,
                                  logit_bias={str(eos): 100})  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(prompt) + 1
    assert r.choices[0].finish_reason == "stop"


def test_prompt_logprobs_as_vllm_names_them(client, long_model):
    prompt = [5, 17, 93, 42]
    want, _ = hf_prompt_log_probs(long_model, prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0,
                                  extra_body={"prompt_logprobs": 1})  # fmt: skip
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(prompt)
    for token, entry, lp in zip(prompt[1:], got[1:], want, strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(lp, abs=TOL)
        assert 1 <= len(entry) <= 2  # the token itself and the likeliest there
    assert not r.choices[0].text.startswith("<s>")  # not echoed


def test_echo_and_prompt_logprobs_refusals_name_the_field(client):
    cases: list[tuple[dict[str, Any], str]] = [
        ({"max_tokens": 0}, "max_tokens"), ({"echo": True, "stream": True}, "echo"),
        ({"echo": True, "logprobs": 1, "stop": ["x"]}, "stop")]  # fmt: skip
    for kw, field in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="hi", **{"max_tokens": 2, **kw})
        assert field in e.value.body["message"]


def test_tokenize_and_detokenize(client, service, long_model):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(long_model / "tokenizer.json"))
    base = service.http_url
    got = client.post(f"{base}/tokenize", body={"model": MODEL, "prompt": "Hello there"}, cast_to=object)
    want = tokenizer.encode("Hello there").ids
    assert got["tokens"] == want and got["count"] == len(want) and got["max_model_len"] > 0
    bare = client.post(f"{base}/tokenize", body={"prompt": "Hello there", "add_special_tokens": False}, cast_to=object)
    assert bare["tokens"] == tokenizer.encode("Hello there", add_special_tokens=False).ids
    chat = client.post(f"{base}/tokenize", body={"messages": [{"role": "user", "content": "hi"}]}, cast_to=object)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert chat["count"] == r.usage.prompt_tokens  # as the chat endpoint renders it
    text = client.post(f"{base}/detokenize", body={"tokens": want}, cast_to=object)
    assert text["prompt"] == tokenizer.decode(want, skip_special_tokens=False)
    with pytest.raises(openai.BadRequestError) as e:
        client.post(f"{base}/detokenize", body={"tokens": [10**7]}, cast_to=object)
    assert e.value.body["param"] == "tokens"
    with pytest.raises(openai.BadRequestError, match="exactly one"):
        client.post(f"{base}/tokenize", body={"model": MODEL}, cast_to=object)
    info = client.get(f"{base}/tokenizer_info", cast_to=object)
    assert info["model"] == MODEL and info["vocab_size"] == tokenizer.get_vocab_size(with_added_tokens=True)
    assert info["eos_token"] in tokenizer.get_vocab() and "<|im_start|>" in info["chat_template"]
    with pytest.raises(openai.NotFoundError):
        client.get(f"{base}/tokenizer_info?model=nope", cast_to=object)
