"""The wire models mirror the executor's dataclasses field for field, so the
service converts between them by name. (The sampling and output options, the
finish reasons and the stats are declared once and need no parity: test_options.py
and test_stats.py check how the wire models are derived from them.)"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

import protocol as p
from worker.executor import types as ex


def dataclass_defaults(cls: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = PydanticUndefined
    return out


def model_defaults(cls: type[BaseModel]) -> dict[str, Any]:
    return {name: f.get_default(call_default_factory=True) for name, f in cls.model_fields.items()}


def as_plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


# What a gateway reads and strips (a chat's messages and tools, stop strings) or names, and the
# hand-off between prefill and decode workers (their service layers', not the executor's).
SUBMIT_WIRE_ONLY = {"request_id", "model", "prompt", "messages", "stop", "client_request_id", "tools", "tool_choice",
                    "parallel_tool_calls", "kv_handoff", "kv_transfer_id"}  # fmt: skip


@pytest.mark.parametrize(
    ("wire", "executor", "wire_only"),
    [
        (p.GuidedDecodingParams, ex.GuidedDecodingParams, set()),
        (p.SpeculativeConfig, ex.SpeculativeConfig, set()),
        (p.LoraConfig, ex.LoraConfig, set()),
        (p.Submit, ex.Request, SUBMIT_WIRE_ONLY),
        (p.Result, ex.Result, {"text", "tool_calls"}),
        (p.Response, ex.Response, set()),
    ],
)
def test_fields_and_defaults_match(wire: type[BaseModel], executor: Any, wire_only: set[str]):
    mine = model_defaults(wire)
    theirs = dataclass_defaults(executor)
    assert set(mine) - wire_only == set(theirs)
    for name, default in theirs.items():
        if name == "input_token_ids":  # optional on the wire: a prompt may stand in
            continue
        assert as_plain(mine[name]) == as_plain(default), name


def test_a_submit_converts_to_an_executor_request_by_name():
    msg = p.Submit(
        request_id="r",
        input_token_ids=[1, 2],
        max_tokens=3,
        sampling_config=p.SamplingConfig(temperature=0.5, top_k=4, seed=9),
        guided_decoding_params=p.GuidedDecodingParams(guide_type="regex", guide="a+"),
    )
    fields = msg.model_dump(exclude=SUBMIT_WIRE_ONLY)
    request = ex.Request(
        **{
            **fields,
            "sampling_config": ex.SamplingConfig(**fields["sampling_config"]),
            "output_config": ex.OutputConfig(**fields["output_config"]),
            "guided_decoding_params": ex.GuidedDecodingParams(**fields["guided_decoding_params"]),
        }
    )
    assert request.input_token_ids == [1, 2]
    assert request.sampling_config.temperature == 0.5
    assert request.guided_decoding_params == ex.GuidedDecodingParams("regex", "a+")
