"""protocol.salvage: the request id of a message refused before it was parsed."""

from __future__ import annotations

import msgpack
import pytest

import protocol
from protocol.salvage import salvage_request_id


def _packed(value: object) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def test_decode_names_the_request_of_an_over_limit_message():
    data = _packed([1, "submit", {"prompt": "x" * (5 << 20), "request_id": "r1", "max_tokens": 4}])
    with pytest.raises(protocol.ProtocolError, match="exceeds") as e:
        protocol.decode(data)
    assert e.value.request_id == "r1"


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1garbage",
        _packed([1, "submit"]),
        _packed([1, "submit", {"request_id": 7}]),
        _packed([1, "submit", {"request_id": "x" * 300}]),
        _packed([1, "submit", [[[[[[[[[[[]]]]]]]]]]]]),
        _packed([1, "submit", {"prompt": "p"}])[:-1],
    ],
)
def test_no_id_where_none_can_be_told(data):
    assert salvage_request_id(data) is None
