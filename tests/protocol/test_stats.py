"""The iteration and request stats are declared once (protocol/stats.py); the
executor produces those dataclasses and the wire's messages are built from them."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

import protocol
from protocol import stats
from protocol.status import RequestState
from worker.executor import types as ex

RECORD = dict(request_id="client-7", state="generation", prompt_tokens=3, context_prefill_position=3,
              num_generated_tokens=2, queue_time_ms=0.5, time_to_first_token_ms=None, allocated_blocks=1,
              reused_blocks=0)  # fmt: skip


def test_the_executor_produces_the_declaration_itself():
    assert ex.RequestStats is stats.RequestStats and ex.IterationStats is stats.IterationStats


@pytest.mark.parametrize(("declared", "wire"), [(stats.IterationStats, protocol.IterationStats),
                                                (stats.RequestStats, protocol.RequestStats)])  # fmt: skip
def test_the_wire_message_has_every_declared_field(declared: type, wire: type[protocol.Message]):
    assert list(wire.model_fields) == [f.name for f in dataclasses.fields(declared)]
    for spec in dataclasses.fields(declared):
        field = wire.model_fields[spec.name]
        assert field.is_required() == (spec.default is dataclasses.MISSING
                                       and spec.default_factory is dataclasses.MISSING), spec.name
        if spec.default is not dataclasses.MISSING:
            assert field.default == spec.default


def test_a_request_record_travels_keyed_by_the_client_id_with_its_state_by_name():
    record = protocol.RequestStats(**RECORD)
    assert protocol.decode(protocol.encode(record)) == record
    assert [s.value for s in RequestState] == list(protocol.RequestStats.model_fields["state"].annotation.__args__)  # type: ignore[union-attr]
    with pytest.raises(ValidationError, match="state"):
        protocol.RequestStats(**RECORD | {"state": "sleeping"})


@pytest.mark.parametrize("name", ["prompt_tokens", "allocated_blocks", "queue_time_ms"])
def test_counts_and_durations_are_never_negative(name: str):
    with pytest.raises(ValidationError, match=name):
        protocol.RequestStats(**RECORD | {name: -1})
