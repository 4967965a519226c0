"""Guided decoding with XGrammar: constrained generations on the real default
model all parse and validate; bad guides and a missing XGrammar are clear errors."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.worker.executor.helpers import final_tokens, run_all
from worker.executor import (
    Executor,
    ExecutorConfig,
    FinishReason,
    GuidedDecodingParams,
    KvCacheConfig,
    Request,
    SamplingConfig,
)

pytest.importorskip("xgrammar", reason="guided decoding needs the `guided` extra")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Berlin", "Rome"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,8}-[0-9]{2}"


@pytest.fixture(scope="module")
def executor(default_gguf: Path) -> Iterator[Executor]:
    config = ExecutorConfig(backend="numpy", max_batch_size=64, kv_cache_config=KvCacheConfig(max_tokens=16384))
    with Executor.from_model(default_gguf, config) as ex:
        yield ex


def chat(executor: Executor, text: str) -> list[int]:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    assert executor.chat_template is not None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    prompt = env.from_string(executor.chat_template).render(
        messages=[{"role": "user", "content": text}], add_generation_prompt=True)
    return list(executor.tokenizer.encode(prompt, add_special_tokens=False).ids)


def test_fifty_json_schema_generations_parse_and_validate(executor: Executor) -> None:
    import jsonschema

    prompt = chat(executor, "Describe a person as JSON with their name, age and city.")
    guide = GuidedDecodingParams("json_schema", json.dumps(SCHEMA))
    requests = [Request(input_token_ids=prompt, max_tokens=64, guided_decoding_params=guide,
                        sampling_config=SamplingConfig(temperature=0.8, seed=i)) for i in range(50)]
    outputs = []
    for responses in run_all(executor, requests, timeout=300).values():
        assert responses[-1].result is not None, responses[-1].error_msg
        assert responses[-1].result.finish_reasons == [FinishReason.END_ID]
        text = executor.tokenizer.decode(final_tokens(responses), skip_special_tokens=True)
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA)
        outputs.append(text)
    assert len(set(outputs)) > 10, "the seeds did not vary the outputs: the test shows little"


def test_regex_and_grammar_outputs_match(executor: Executor) -> None:
    prompt = chat(executor, "Give me a code name.")
    regex = [Request(input_token_ids=prompt, max_tokens=16, guided_decoding_params=GuidedDecodingParams("regex", REGEX),
                     sampling_config=SamplingConfig(temperature=1.0, seed=i)) for i in range(20)]
    grammar = Request(input_token_ids=prompt, max_tokens=8, guided_decoding_params=GuidedDecodingParams(
        "ebnf_grammar", 'root ::= ("yes" | "no") " sir"'))
    any_json = Request(input_token_ids=chat(executor, "A JSON list of two numbers."), max_tokens=48,
                       guided_decoding_params=GuidedDecodingParams("json"))
    got = list(run_all(executor, [*regex, grammar, any_json], timeout=300).values())
    texts = [executor.tokenizer.decode(final_tokens(r), skip_special_tokens=True) for r in got]
    for text in texts[:20]:
        assert re.fullmatch(REGEX, text), text
    assert texts[20] in ("yes sir", "no sir")
    if got[21][-1].result.finish_reasons == [FinishReason.END_ID]:  # type: ignore[union-attr]
        json.loads(texts[21])


@pytest.mark.parametrize(
    ("guide", "message"),
    [
        (GuidedDecodingParams("json_schema", "{not json"), "invalid json_schema guide"),
        (GuidedDecodingParams("json_schema", '{"type": "objekt"}'), "invalid json_schema guide"),
        (GuidedDecodingParams("regex", "[a-"), "invalid regex guide"),
        (GuidedDecodingParams("ebnf_grammar", "root ::= "), "invalid ebnf_grammar guide"),
        (GuidedDecodingParams("xml", "x"), "is not one of"),
        (GuidedDecodingParams("regex"), "needs a guide"),
    ],
)
def test_a_bad_guide_is_an_error_for_that_request_alone(tiny_llama: Path, guide: GuidedDecodingParams,
                                                        message: str) -> None:
    config = ExecutorConfig(backend="numpy", kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024))
    with Executor.from_model(tiny_llama, config) as ex:
        good, bad = run_all(ex, [Request(input_token_ids=[5, 6], max_tokens=3, end_id=-1),
                                 Request(input_token_ids=[5, 6], max_tokens=3, guided_decoding_params=guide)]).values()
    assert bad[0].has_error and message in (bad[0].error_msg or ""), bad[0].error_msg
    assert len(final_tokens(good)) == 3


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_guided_on_a_tiny_model_in_both_loops(tiny_llama: Path, overlap: bool) -> None:
    config = ExecutorConfig(backend="numpy", overlap_scheduling=overlap,
                            kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=4096))
    with Executor.from_model(tiny_llama, config) as ex:
        got = run_all(ex, [
            Request(input_token_ids=[5 + i, 6, 7], max_tokens=40, end_id=2, guided_decoding_params=GuidedDecodingParams(
                "regex", "(ab|cd)+!"), sampling_config=SamplingConfig(temperature=1.0, seed=i)) for i in range(6)
        ] + [Request(input_token_ids=[9, 9], max_tokens=10, end_id=-1)])
    texts = set()
    for responses in list(got.values())[:6]:
        assert responses[-1].result.finish_reasons == [FinishReason.END_ID]  # type: ignore[union-attr]
        text = ex.tokenizer.decode(final_tokens(responses), skip_special_tokens=True)
        assert re.fullmatch(r"(ab|cd)+!", text), text
        texts.add(text)
    assert len(texts) > 1


def test_without_xgrammar_guided_requests_name_the_extra(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # what `import xgrammar` meets where it is not installed
    config = ExecutorConfig(backend="numpy", kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024))
    with Executor.from_model(tiny_llama, config) as ex:
        (bad,) = run_all(ex, [Request(input_token_ids=[5, 6], max_tokens=3,
                                      guided_decoding_params=GuidedDecodingParams("json"))]).values()
    assert bad[0].has_error and "the `guided` extra" in (bad[0].error_msg or ""), bad[0].error_msg
