"""The sampling and output options are declared once (protocol/options.py);
the wire models, the executor's types, the client's params and the runtime's
names are derived from that declaration."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import ValidationError

import protocol
from clients.params import SamplingParams
from protocol import options
from protocol.derive import wire_model
from worker.executor import types as ex
from worker.runtime.sampling import _PER_SEQUENCE

DECLARED = [(options.SamplingConfig, protocol.SamplingConfig, "sampling_config"),
            (options.OutputConfig, protocol.OutputConfig, "output_config")]  # fmt: skip


def _constraints(wire: type[protocol.WireModel], name: str) -> dict[str, Any]:
    found = {}
    for item in wire.model_fields[name].metadata:
        for key in ("ge", "gt", "le"):
            if hasattr(item, key):
                found[key] = getattr(item, key)
    return found


@pytest.mark.parametrize(("declared", "wire", "prefix"), DECLARED)
def test_the_wire_model_has_each_option_with_its_default_bounds_and_doc(declared: type, wire: Any, prefix: str):
    assert list(wire.model_fields) == [f.name for f in dataclasses.fields(declared)]
    for spec in dataclasses.fields(declared):
        field = wire.model_fields[spec.name]
        assert field.default == spec.default, spec.name
        assert field.description == spec.metadata["doc"]
        bounds = spec.metadata["bounds"]
        assert _constraints(wire, spec.name) == {k: v for k, v in dataclasses.asdict(bounds).items() if v is not None}


def test_the_executor_uses_the_declaration_itself():
    assert ex.SamplingConfig is options.SamplingConfig and ex.OutputConfig is options.OutputConfig
    assert ex.FinishReason is protocol.FinishReason


def test_every_sampling_option_is_a_client_param_with_its_default():
    params = SamplingParams()
    sent = params.request_fields()
    for spec in dataclasses.fields(options.SamplingConfig):
        assert getattr(params, spec.name) == spec.default, spec.name
        assert spec.name in sent["sampling_config"]
    for spec in dataclasses.fields(options.OutputConfig):
        if spec.name != "exclude_input_from_output":  # outputs never echo the prompt
            assert getattr(params, spec.name) == spec.default, spec.name
            assert spec.name in sent["output_config"]
    # what a client sends is what the wire and the executor take
    ex.SamplingConfig(**sent["sampling_config"])
    protocol.Submit(request_id="r", input_token_ids=[1], **sent)


def test_the_runtime_sets_every_per_sequence_option():
    assert set(_PER_SEQUENCE.values()) == {f.name for f in dataclasses.fields(options.SamplingConfig)} - {"beam_width"}


def _outside(bounds: options.Bounds) -> list[float]:
    values = []
    if bounds.ge is not None:
        values.append(bounds.ge - 1 if isinstance(bounds.ge, int) else bounds.ge - 0.01)
    if bounds.gt is not None:
        values.append(bounds.gt)
    if bounds.le is not None:
        values.append(bounds.le + 1 if isinstance(bounds.le, int) else bounds.le + 0.01)
    return values


def _inside(bounds: options.Bounds) -> list[float]:
    return [v for v in (bounds.ge, bounds.le) if v is not None]


CASES = [(declared, wire, prefix, name, bounds)
         for declared, wire, prefix in DECLARED
         for name, bounds in options.option_bounds(declared).items()]  # fmt: skip


@pytest.mark.parametrize(("declared", "wire", "prefix", "name", "bounds"), CASES, ids=[c[3] for c in CASES])
def test_wire_and_executor_refuse_the_same_values(declared: type, wire: Any, prefix: str, name: str,
                                                  bounds: options.Bounds) -> None:
    for value in _outside(bounds):
        with pytest.raises(ValidationError, match=name):
            wire.model_validate({name: value})
        assert options.out_of_bounds(declared(**{name: value}), prefix) == (
            f"{prefix}.{name} must be {bounds.describe()}, got {value}")
    for value in _inside(bounds):
        wire.model_validate({name: value})
        assert options.out_of_bounds(declared(**{name: value}), prefix) is None


def test_a_declared_option_becomes_a_wire_field_with_its_bounds():
    @dataclass(slots=True)
    class Knobs:
        """Made-up options."""

        warmth: float | None = options.option(None, "how warm", gt=0.0, le=2.0)
        count: int = options.option(3, "how many", ge=1)

    wire = wire_model(Knobs, module=__name__)
    assert wire.__doc__ == "Made-up options." and wire().model_dump() == {"warmth": None, "count": 3}
    assert wire.model_validate({"warmth": 2.0}).warmth == 2.0  # type: ignore[attr-defined]
    with pytest.raises(ValidationError, match="warmth"):
        wire.model_validate({"warmth": 0.0})
    with pytest.raises(ValidationError, match="count"):
        wire.model_validate({"count": 0})
    with pytest.raises(ValidationError, match="Extra inputs"):
        wire.model_validate({"coolness": 1})
    assert options.out_of_bounds(Knobs(warmth=2.5), "knobs") == "knobs.warmth must be in (0, 2], got 2.5"
    assert options.out_of_bounds(Knobs(count=0), "knobs") == "knobs.count must be >= 1, got 0"
