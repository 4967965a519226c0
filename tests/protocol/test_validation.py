"""Bad messages are refused with a ProtocolError that says what is wrong."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

import protocol as p
from protocol.packed import pack_ints


def decode_payload(kind: str, payload: Any) -> p.Message:
    return p.decode(msgpack.packb([1, kind, payload], use_bin_type=True))


def submit(**fields: Any) -> dict[str, Any]:
    return {"request_id": "req-1", "prompt": "hello", "max_tokens": 8, **fields}


@pytest.mark.parametrize(
    ("fields", "where", "rule"),
    [
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"sampling_config": {"top_p": -0.1}}, "sampling_config.top_p", "greater than or equal to 0"),
        ({"sampling_config": {"top_p": 1.5}}, "sampling_config.top_p", "less than or equal to 1"),
        (
            {"sampling_config": {"temperature": -0.1}},
            "sampling_config.temperature",
            "greater than or equal to 0",
        ),
        ({"sampling_config": {"beam_width": 0}}, "sampling_config.beam_width", "greater than or equal to 1"),
        ({"sampling_config": {"top_k": -1}}, "sampling_config.top_k", "greater than or equal to 0"),
        ({"sampling_config": {"min_p": 2.0}}, "sampling_config.min_p", "less than or equal to 1"),
        (
            {"sampling_config": {"repetition_penalty": 0.0}},
            "sampling_config.repetition_penalty",
            "greater than 0",
        ),
        ({"sampling_config": {"temperature": float("nan")}}, "sampling_config.temperature", "finite number"),
        ({"sampling_config": {"seed": -1}}, "sampling_config.seed", "greater than or equal to 0"),
        ({"priority": 1.5}, "priority", "less than or equal to 1"),
        ({"num_return_sequences": 0}, "num_return_sequences", "greater than or equal to 1"),
        (
            {"output_config": {"top_n_log_probs": -1}},
            "output_config.top_n_log_probs",
            "greater than or equal",
        ),
        ({"max_tokens": "8"}, "max_tokens", "valid integer"),
        ({"streaming": 1}, "streaming", "valid boolean"),
        ({"prompt": ""}, "prompt", "at least 1 character"),
        ({"request_id": ""}, "request_id", "at least 1 character"),
        ({"stop_words": [b""]}, "stop_words.0", "at least 1 item"),
        ({"end_id": -2}, "end_id", "greater than or equal to -1"),
        ({"bogus": 1}, "bogus", "Extra inputs are not permitted"),
        ({"guided_decoding_params": {"guide_type": "xml"}}, "guided_decoding_params.guide_type", "'json'"),
        ({"lora_config": {"name": ""}}, "lora_config.name", "at least 1 character"),
        ({"lora_config": {}}, "lora_config.name", "Field required"),
    ],
)
def test_submit_field_rules(fields: dict[str, Any], where: str, rule: str):
    with pytest.raises(p.ProtocolError) as info:
        decode_payload("submit", submit(**fields))
    message = str(info.value)
    assert message.startswith("invalid submit: ")
    assert f"{where}: " in message
    assert rule in message
    assert info.value.kind == "submit"
    assert info.value.request_id == (None if where == "request_id" else "req-1")


@pytest.mark.parametrize(
    ("fields", "rule"),
    [
        ({"prompt": None}, "exactly one of prompt, messages and input_token_ids"),
        ({"input_token_ids": b"\x01\x00\x00\x00"}, "exactly one of prompt, messages and input_token_ids"),
        ({"sampling_config": {"beam_width": 2}, "num_return_sequences": 3}, "must not exceed"),
        ({"guided_decoding_params": {"guide_type": "regex"}}, "needs a non-empty guide"),
    ],
)
def test_submit_cross_field_rules(fields: dict[str, Any], rule: str):
    payload = {k: v for k, v in submit(**fields).items() if v is not None}
    with pytest.raises(p.ProtocolError, match=rule):
        decode_payload("submit", payload)


def test_packed_token_ids_must_be_whole_int32s():
    payload = submit(prompt=None, input_token_ids=b"\x01\x00\x00")
    del payload["prompt"]
    with pytest.raises(p.ProtocolError, match=r"input_token_ids: .*not a multiple of 4"):
        decode_payload("submit", payload)


def test_negative_packed_token_id_is_refused():
    payload = submit(input_token_ids=(-5).to_bytes(4, "little", signed=True))
    del payload["prompt"]
    with pytest.raises(p.ProtocolError, match=r"input_token_ids.0: .*greater than or equal to 0"):
        decode_payload("submit", payload)


def test_nan_in_packed_floats_is_refused():
    payload = submit(embedding_bias=b"\x00\x00\xc0\x7f")  # float32 NaN
    with pytest.raises(p.ProtocolError, match=r"embedding_bias: .*NaN"):
        decode_payload("submit", payload)


def test_response_needs_exactly_one_of_result_and_error():
    with pytest.raises(p.ProtocolError, match="exactly one of result and error_msg"):
        decode_payload("results", {"responses": [{"request_id": "a"}]})


def test_result_fields_per_beam_must_agree():
    result = {"is_final": True, "output_token_ids": [b"", b""], "finish_reasons": [1]}
    with pytest.raises(p.ProtocolError, match="finish_reasons has 1 entries; output_token_ids has 2 beams"):
        decode_payload("results", {"responses": [{"request_id": "a", "result": result}]})


def _ints(*values: int) -> bytes:
    return pack_ints(values)


@pytest.mark.parametrize(
    ("streamed", "rule"),
    [
        ({"request_ids": ["a", "b"], "counts": _ints(1), "token_ids": _ints(7)}, "1 counts for 2 request ids"),
        ({"request_ids": ["a"], "counts": _ints(0), "token_ids": b""}, "a streamed step carries at least one token"),
        ({"request_ids": ["a"], "counts": _ints(2), "token_ids": _ints(7)}, "add up to 2 tokens; token_ids has 1"),
        ({"request_ids": [""], "counts": _ints(1), "token_ids": _ints(7)}, "streamed.request_ids.0"),
        ({"request_ids": ["a", "b"], "counts": _ints(1, 1), "token_ids": _ints(7, 8), "text": ["x"]},
         "1 texts for 2 request ids"),
    ],
)
def test_streamed_columns_must_agree(streamed: dict[str, Any], rule: str):
    with pytest.raises(p.ProtocolError, match=rule):
        decode_payload("results", {"streamed": streamed})


def test_streamed_columns_stand_for_responses_before_the_others():
    final = {"is_final": True, "output_token_ids": [_ints(9)], "finish_reasons": [3], "is_sequence_final": True}
    batch = decode_payload("results", {
        "responses": [{"request_id": "a", "result": final}],
        "streamed": {"request_ids": ["a", "b", "a"], "counts": _ints(2, 1, 1), "token_ids": _ints(5, 6, 7, 8)},
    })  # fmt: skip
    assert isinstance(batch, p.ResultBatch)
    got = [(r.request_id, r.result.output_token_ids, r.result.is_final) for r in batch.all_responses() if r.result]
    assert got == [("a", [[5, 6]], False), ("b", [[7]], False), ("a", [[8]], False), ("a", [[9]], True)]
    assert all(r.result.finish_reasons == [p.FinishReason.NOT_FINISHED] for r in batch.all_responses()[:3] if r.result)


def test_streamed_text_is_each_response_s_text():
    batch = decode_payload("results", {
        "streamed": {"request_ids": ["a", "b"], "counts": _ints(2, 1), "token_ids": _ints(5, 6, 7), "text": ["hi", ""]},
    })  # fmt: skip
    assert isinstance(batch, p.ResultBatch)
    assert [(r.request_id, r.result.text) for r in batch.all_responses() if r.result] == [("a", ["hi"]), ("b", [""])]


def test_unknown_finish_reason_is_refused():
    result = {"is_final": True, "output_token_ids": [b""], "finish_reasons": [9]}
    with pytest.raises(p.ProtocolError, match=r"finish_reasons.0"):
        decode_payload("results", {"responses": [{"request_id": "a", "result": result}]})


def test_logits_size_must_match_shape():
    result = {
        "is_final": True,
        "output_token_ids": [b""],
        "finish_reasons": [1],
        "context_logits": {"shape": [2, 3], "data": b"\x00" * 20},
    }
    with pytest.raises(p.ProtocolError, match="shape \\[2, 3\\] needs 24"):
        decode_payload("results", {"responses": [{"request_id": "a", "result": result}]})


def test_error_code_must_be_known():
    with pytest.raises(p.ProtocolError, match="code"):
        decode_payload("error", {"code": "oops", "message": "x"})
    msg = decode_payload("error", {"code": "overloaded", "message": "busy", "request_id": "r"})
    assert msg == p.ErrorReply(code=p.ErrorCode.OVERLOADED, message="busy", request_id="r")


@pytest.mark.parametrize(
    ("envelope", "rule"),
    [
        ([2, "cancel", {"request_id": "r"}], "unsupported protocol version 2; this side speaks 1"),
        (["1", "cancel", {"request_id": "r"}], "unsupported protocol version '1'"),
        ([1, "launch", {}], "unknown message kind 'launch'; known kinds: submit, cancel"),
        ([1, 7, {}], "unknown message kind 7"),
        ([1, "cancel", ["r"]], "cancel payload must be a map, got a list of 1 item"),
        ([1, "cancel"], "a message must be \\[version, kind, payload\\], got a list of 2 items"),
        ({"version": 1}, "a message must be \\[version, kind, payload\\], got a map of 1 item"),
        (42, "a message must be \\[version, kind, payload\\], got 42"),
    ],
)
def test_envelope_errors(envelope: Any, rule: str):
    with pytest.raises(p.ProtocolError, match=rule):
        p.decode(msgpack.packb(envelope))


@pytest.mark.parametrize(
    ("data", "rule"),
    [
        (b"", "malformed msgpack"),
        (b"\xc1", "malformed msgpack"),  # the one byte msgpack never uses
        (b"\x93\x01", "malformed msgpack"),
        (msgpack.packb([1, "cancel", {"request_id": "r"}]) + b"\x00", "trailing bytes"),
        (b"\x93\x01\xa6cancel\x81\x01\xa1r", "malformed msgpack"),  # integer map key
        (b"\x93\x01\xa6cancel\x81\xaarequest_id\xa2\xff\xfe", "malformed msgpack"),  # invalid UTF-8
        (b"\x93\x01\xa6cancel\xd4\x05\x00", "malformed msgpack"),  # ext type
    ],
)
def test_malformed_bytes(data: bytes, rule: str):
    with pytest.raises(p.ProtocolError, match=rule):
        p.decode(data)


def test_non_bytes_input_is_a_protocol_error():
    with pytest.raises(p.ProtocolError, match="a message is bytes, got str"):
        p.decode("hello")  # type: ignore[arg-type]


def test_bytearray_and_memoryview_decode():
    wire = p.encode(p.Cancel(request_id="r"))
    assert p.decode(bytearray(wire)) == p.Cancel(request_id="r")
    assert p.decode(memoryview(wire)) == p.Cancel(request_id="r")


def test_many_errors_are_summarised():
    with pytest.raises(p.ProtocolError) as info:
        decode_payload("iteration_stats", {})
    assert "and 9 more" in str(info.value)


def test_constructing_an_invalid_message_fails_early():
    with pytest.raises(ValueError, match="max_tokens"):
        p.Submit(request_id="r", prompt="x", max_tokens=0)


def test_packed_rows_must_divide_evenly():
    result = {"is_final": True, "output_token_ids": [b""], "finish_reasons": [1], "top_token_ids": [[2, b"\x00" * 12]]}
    with pytest.raises(p.ProtocolError, match="3 packed values do not divide into rows of 2"):
        decode_payload("results", {"responses": [{"request_id": "a", "result": result}]})


def test_ragged_rows_cannot_be_encoded():
    result = p.Result(
        is_final=True, output_token_ids=[[1, 2]], finish_reasons=[p.FinishReason.END_ID], top_token_ids=[[[1, 2], [3]]]
    )
    with pytest.raises(p.ProtocolError, match="rows of unequal length"):
        p.encode(p.ResultBatch(responses=[p.Response(request_id="a", result=result)]))


def test_kv_events_with_a_broken_packed_hash_list_are_refused_by_name():
    wire = msgpack.packb([1, "kv_events", {"sender_id": "w", "incarnation": "i", "seq": 1, "stored": b"\0" * 12}])
    with pytest.raises(p.ProtocolError, match=r"kv_events: stored.*not a multiple of 8"):
        p.decode(wire)


def test_kv_events_are_numbered_from_one():
    wire = msgpack.packb([1, "kv_events", {"sender_id": "w", "incarnation": "i", "seq": 0}])
    with pytest.raises(p.ProtocolError, match="seq"):
        p.decode(wire)
