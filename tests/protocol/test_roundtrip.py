"""Every message kind survives encode -> decode unchanged."""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

import protocol as p
from tests.protocol.strategies import MESSAGES

NOT_FINISHED = p.FinishReason.NOT_FINISHED


def test_every_kind_has_a_strategy():
    assert set(MESSAGES) == set(p.KINDS)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_round_trip(data: st.DataObject):
    for kind, strategy in MESSAGES.items():
        msg = data.draw(strategy, label=kind)
        wire = p.encode(msg)
        decoded = p.decode(wire)
        assert type(decoded) is type(msg)
        assert decoded == msg
        assert p.encode(decoded) == wire


def test_envelope_is_version_kind_payload():
    wire = p.encode(p.Cancel(request_id="r-1"))
    assert msgpack.unpackb(wire) == [1, "cancel", {"request_id": "r-1"}]


def test_defaults_are_left_out_and_filled_back_in():
    msg = p.Submit(request_id="r", prompt="hi", max_tokens=4)
    payload = msgpack.unpackb(p.encode(msg))[2]
    assert payload == {"request_id": "r", "prompt": "hi", "max_tokens": 4}
    decoded = p.decode(p.encode(msg))
    assert isinstance(decoded, p.Submit)
    assert decoded.priority == 0.5
    assert decoded.output_config.exclude_input_from_output is True


def test_token_ids_travel_packed_not_as_per_token_values():
    batch = p.ResultBatch(
        responses=[
            p.Response(
                request_id="a",
                result=p.Result(is_final=False, output_token_ids=[[7, 8]], finish_reasons=[NOT_FINISHED]),
            )
        ]
    )
    result = msgpack.unpackb(p.encode(batch))[2]["responses"][0]["result"]
    assert result["output_token_ids"] == [(7).to_bytes(4, "little") + (8).to_bytes(4, "little")]


def test_plain_model_dump_keeps_lists():
    msg = p.Submit(request_id="r", input_token_ids=[1, 2], max_tokens=1, embedding_bias=[0.5])
    dumped = msg.model_dump()
    assert dumped["input_token_ids"] == [1, 2]
    assert dumped["embedding_bias"] == [0.5]


def test_decode_with_payload_gives_the_fields_as_they_came_to_pass_on():
    msg = p.Submit(request_id="r", input_token_ids=[1, 2, 3], max_tokens=4, stop=["x"])
    decoded, payload = p.decode_with_payload(p.encode(msg))
    assert decoded == msg
    assert payload == msgpack.unpackb(p.encode(msg))[2]  # packed ids stay bytes
    passed_on = {k: v for k, v in payload.items() if k != "stop"} | {"request_id": "r~1"}
    assert p.decode(p.encode_payload("submit", passed_on)) == msg.model_copy(update={"request_id": "r~1", "stop": None})
