"""Lists of numbers as packed little-endian bytes on the wire.

In Python the fields are plain lists; `encode` packs them (int32 for token ids,
float32 for log probs and biases) and `decode` unpacks them before validation.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, PlainSerializer, SerializationInfo, ValidationInfo

INT32_MAX = 2**31 - 1

# The context `encode` passes to model_dump; any other dump keeps plain lists.
WIRE_CONTEXT = {"wire": True}

_LITTLE = sys.byteorder == "little"
if array("i").itemsize != 4 or array("f").itemsize != 4:
    raise ImportError("protocol.packed needs a platform with 4-byte C int and float")


def pack_ints(values: Sequence[int]) -> bytes:
    return _pack("i", values)


def pack_floats(values: Sequence[float]) -> bytes:
    return _pack("f", values)


def _pack(typecode: str, values: Sequence[Any]) -> bytes:
    a = array(typecode, values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def _unpack(typecode: str, data: bytes) -> Any:
    if len(data) & 3:
        kind = "int32" if typecode == "i" else "float32"
        raise ValueError(f"packed {kind} data is {len(data)} bytes, not a multiple of 4")
    a = array(typecode, data)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


class Unpacking:
    """Validation context of one `decode`: how many more packed values it may
    expand into Python lists. A list of ints costs ~36 bytes per value against 4
    on the wire, so this, not the message size, bounds decode's memory."""

    __slots__ = ("limit", "remaining")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.remaining = limit


def _spend(data: bytes, info: ValidationInfo) -> None:
    budget = info.context
    if type(budget) is Unpacking:
        budget.remaining -= len(data) >> 2
        if budget.remaining < 0:
            raise ValueError(f"the message packs more than max_packed_values ({budget.limit}) numbers")


def _from_wire_ints(value: object, info: ValidationInfo) -> object:
    if type(value) is not bytes:
        return value
    _spend(value, info)
    # _unpack inlined for the little-endian common case: this runs for every
    # token list of every result.
    if _LITTLE and not len(value) & 3:
        return array("i", value).tolist()
    return _unpack("i", value)


def _from_wire_floats(value: object, info: ValidationInfo) -> object:
    if type(value) is not bytes:
        return value
    _spend(value, info)
    return _unpack("f", value)


def _reject_nan(values: list[float]) -> list[float]:
    if any(map(math.isnan, values)):
        raise ValueError("NaN is not allowed")
    return values


def _to_wire_ints(value: list[int], info: SerializationInfo) -> list[int] | bytes:
    return pack_ints(value) if info.context is WIRE_CONTEXT else value


def _to_wire_floats(value: list[float], info: SerializationInfo) -> list[float] | bytes:
    return pack_floats(value) if info.context is WIRE_CONTEXT else value


TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]

# Token ids: int32 on the wire.
TokenIds = Annotated[
    list[TokenId],
    BeforeValidator(_from_wire_ints),
    PlainSerializer(_to_wire_ints, when_used="unless-none"),
]

# Per-token floats (log probs, embedding bias): float32 on the wire; +-inf allowed
# (a bias of -inf bans a token), NaN never.
Floats = Annotated[
    list[Annotated[float, Field(allow_inf_nan=True)]],
    BeforeValidator(_from_wire_floats),
    AfterValidator(_reject_nan),
    PlainSerializer(_to_wire_floats, when_used="unless-none"),
]


def _rows_from_wire(typecode: str, value: object, info: ValidationInfo) -> object:
    """[width, packed] back into rows of `width` values; anything else is left
    for the list validation to judge."""
    if not (type(value) is list and len(value) == 2 and type(value[0]) is int and type(value[1]) is bytes):
        return value
    width, data = value
    _spend(data, info)
    flat = _unpack(typecode, data)
    if width < 1:
        if flat:
            raise ValueError(f"packed rows of width {width} cannot hold {len(flat)} values")
        return []
    if len(flat) % width:
        raise ValueError(f"{len(flat)} packed values do not divide into rows of {width}")
    return [flat[i : i + width] for i in range(0, len(flat), width)]


def _rows_to_wire(pack: Any, value: list[list[Any]], info: SerializationInfo) -> object:
    if info.context is not WIRE_CONTEXT:
        return value
    width = len(value[0]) if value else 0
    if any(len(row) != width for row in value):
        raise ValueError(f"rows of unequal length cannot be packed (first has {width})")
    return [width, pack([x for row in value for x in row])]


def _int_rows_from_wire(value: object, info: ValidationInfo) -> object:
    return _rows_from_wire("i", value, info)


def _float_rows_from_wire(value: object, info: ValidationInfo) -> object:
    return _rows_from_wire("f", value, info)


def _int_rows_to_wire(value: list[list[int]], info: SerializationInfo) -> object:
    return _rows_to_wire(pack_ints, value, info)


def _float_rows_to_wire(value: list[list[float]], info: SerializationInfo) -> object:
    return _rows_to_wire(pack_floats, value, info)


# Rows of equal length (per generated token: its top-N candidates): one
# [width, packed] pair on the wire rather than an array per token.
TokenIdRows = Annotated[
    list[list[TokenId]],
    BeforeValidator(_int_rows_from_wire),
    PlainSerializer(_int_rows_to_wire),
]
FloatRows = Annotated[
    list[Annotated[list[Annotated[float, Field(allow_inf_nan=True)]], AfterValidator(_reject_nan)]],
    BeforeValidator(_float_rows_from_wire),
    PlainSerializer(_float_rows_to_wire),
]
