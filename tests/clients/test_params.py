"""SamplingParams is the one definition of a request's options: every field
reaches the wire's Submit and the executor's Request, every option of those is
reachable from it, and the service's path (Submit, then the worker's
conversion) builds the same executor Request as the in-process LLM."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from clients.llm import executor_request
from clients.params import SamplingParams, Speculation, sampling_params
from clients.wire import to_submit
from worker.service.convert import to_request

PROMPT = [5, 6, 7]

# A value other than the default for every field. A new field must be added
# here, and so to the checks below.
SAMPLES: dict[str, Any] = {
    "max_tokens": 17,
    "temperature": 0.25,
    "top_k": 7,
    "top_p": 0.75,
    "top_p_min": 0.125,
    "top_p_reset_ids": 3,
    "top_p_decay": 0.5,
    "min_p": 0.0625,
    "seed": 99,
    "min_tokens": 2,
    "repetition_penalty": 1.5,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
    "no_repeat_ngram_size": 3,
    "beam_width": 3,
    "length_penalty": 0.75,
    "early_stopping": 1,
    "beam_search_diversity_rate": 0.5,
    "num_return_sequences": 2,
    "stop": ["\n\n"],
    "stop_token_ids": [[9, 10]],
    "bad_token_ids": [[11]],
    "end_id": 4,
    "ignore_eos": True,
    "return_log_probs": True,
    "top_n_log_probs": 2,
    "prompt_log_probs": 1,
    "return_context_logits": True,
    "return_generation_logits": True,
    "embedding_bias": [0.5, -1.0, 0.0],
    "logits_post_processor": "no_digits",
    "guided_json": {"type": "object"},
    "guided_regex": "[ab]+",
    "guided_grammar": 'root ::= "yes" | "no"',
    "priority": 0.75,
    "speculative": Speculation(source="draft_tokens", num_draft_tokens=5, draft_tokens=[3, 4], max_ngram=4,
                               min_ngram=2),
    "lora": "sql",
}
# Options of the Submit and the Request that are not request options, and why.
NOT_OPTIONS = {
    "request_id",  # chosen per call (Client.submit's request_id, a job's id)
    "model",  # Client.submit's and JobQueue.submit's model
    "prompt",
    "messages",  # a chat's turns, in place of the prompt (Client.chat)
    "tools",  # a chat's tools and how they are used: Client.chat's, LLM.chat's and a chat job's arguments
    "tool_choice",
    "parallel_tool_calls",
    "kv_handoff",  # set by a gateway toward a prefill worker (disaggregated serving)
    "kv_transfer_id",  # and toward the decode worker that continues it
    "input_token_ids",
    "streaming",  # how the output is delivered: Client.stream, LLM.generate_async(streaming=True)
    "client_id",  # a transport tag
    "client_request_id",  # filled by a gateway toward a worker
    "pad_id",  # unused by the executor
    "return_all_generated_tokens",  # the APIs accumulate streamed tokens themselves
    "output_config.exclude_input_from_output",  # outputs hold generated tokens; the prompt's are on RequestOutput
    "prompt_tuning_config",  # embeddings for the prompt's ids past the vocabulary: part of the prompt (a Submit's)
    "resumed_token_ids",  # a continuation's: set by a gateway or the client library when a stream moves
    "embedding_config",  # another kind of request (an embedding, nothing generated), not a generation option
}


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A Submit's or a Request's fields by dotted path, the configs flattened."""
    fields = value.model_dump() if hasattr(value, "model_dump") else dataclasses.asdict(value)
    out: dict[str, Any] = {}
    for name, v in fields.items():
        if isinstance(v, dict) and name in ("sampling_config", "output_config"):
            out.update({f"{name}.{k}": x for k, x in v.items()})
        else:
            out[f"{prefix}{name}"] = v
    return out


def _changed(build: Any, name: str) -> set[str]:
    """The paths of what setting only `name` changes."""
    base = _flat(build(SamplingParams()))
    one = _flat(build(SamplingParams(**{name: SAMPLES[name]})))
    return {path for path in base if base[path] != one[path]}


def _wire(p: SamplingParams) -> Any:
    return to_submit(PROMPT, p, request_id="r")


def _executor(p: SamplingParams) -> Any:
    return executor_request(PROMPT, p, streaming=False)


def test_every_field_has_a_sample():
    assert set(SAMPLES) == {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_field_reaches_the_submit(name: str):
    assert _changed(_wire, name), f"SamplingParams.{name} does not reach the wire's Submit"


@pytest.mark.parametrize("name", sorted(set(SAMPLES) - {"stop"}))
def test_every_field_reaches_the_executor_request(name: str):
    # Stop strings are matched on the text (protocol/text.py), not by the executor.
    assert _changed(_executor, name), f"SamplingParams.{name} does not reach the executor's Request"


def test_the_stop_strings_travel_in_the_submit():
    assert _wire(SamplingParams(stop=["\n\n", "END"])).stop == ["\n\n", "END"]
    assert _wire(SamplingParams()).stop is None


@pytest.mark.parametrize("build", [_wire, _executor], ids=["submit", "request"])
def test_every_option_is_reachable(build: Any):
    reached = set().union(*(_changed(build, name) for name in SAMPLES))
    options = set(_flat(build(SamplingParams()))) - NOT_OPTIONS
    assert options <= reached, f"no SamplingParams field reaches {sorted(options - reached)}"


@pytest.mark.parametrize("name", sorted(set(SAMPLES) - {"stop"}))
def test_the_service_and_the_llm_build_the_same_request(name: str):
    p = SamplingParams(**{name: SAMPLES[name]})
    assert to_request(_wire(p)) == _executor(p)


def test_guided_decoding_takes_one_guide():
    guide = _wire(SamplingParams(guided_json=True)).guided_decoding_params
    assert guide is not None and (guide.guide_type, guide.guide) == ("json", None)
    with pytest.raises(ValueError, match="at most one of"):
        SamplingParams(guided_json=True, guided_regex="a").request_fields()


def test_keyword_options_override_the_params():
    base = SamplingParams(max_tokens=5, temperature=0.5)
    assert sampling_params(base, {"temperature": 0.0}) == SamplingParams(max_tokens=5, temperature=0.0)
    assert sampling_params(None, {}) == SamplingParams()
    with pytest.raises(TypeError, match="max_token"):
        sampling_params(None, {"max_token": 5})
