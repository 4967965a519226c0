"""Messages to bytes and back: one msgpack value `[version, kind, payload]`.

`decode` is the trust boundary. Whatever the input, it returns a validated
message or raises `ProtocolError`; the limits bound the memory it may use.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from protocol.base import Message
from protocol.control import Cancel, Drain, ErrorReply, Heartbeat, Hello, LoraAdapters, LoraLoad, LoraUnload, Ready
from protocol.errors import ProtocolError
from protocol.kv_cache import KvEvents, KvSnapshot, KvSnapshotRequest
from protocol.kv_transfer import HandedOff, KvAck, KvTransfer
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.packed import WIRE_CONTEXT, Unpacking
from protocol.records import IterationStats, RequestStats, WorkerInfo
from protocol.request import Submit
from protocol.results import ResultBatch
from protocol.salvage import salvage_request_id
from protocol.submit_batch import MAX_SUBMITS, SubmitBatch

VERSION = 1

KINDS: dict[str, type[Message]] = {
    cls.kind: cls
    for cls in (
        Submit,
        Cancel,
        ResultBatch,
        ErrorReply,
        Heartbeat,
        Hello,
        Ready,
        Drain,
        WorkerInfo,
        IterationStats,
        RequestStats,
        LoraLoad,
        LoraUnload,
        LoraAdapters,
        KvEvents,
        KvSnapshot,
        KvSnapshotRequest,
        KvTransfer,
        KvAck,
        HandedOff,
        SubmitBatch,
    )
}

_MAX_ERRORS_SHOWN = 3
# What a SubmitBatch adds to its submits' bytes, at most: the envelope, and a bin header each.
_BATCH_ENVELOPE_BYTES = 64
_BATCH_ITEM_BYTES = 5


def encode(msg: Message, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Serialize a message. Fields equal to their default are left out (the
    receiver fills them back in), which keeps hot-path messages short."""
    try:
        payload = msg.model_dump(context=WIRE_CONTEXT, exclude_defaults=True)
    except (PydanticSerializationError, OverflowError, ValueError, TypeError) as e:
        # e.g. rows of unequal length to pack, or an integer beyond 64 bits
        raise ProtocolError(f"cannot encode {msg.kind}: {e}", kind=msg.kind) from None
    return encode_payload(msg.kind, payload, limits, request_id=getattr(msg, "request_id", None))


def encode_payload(kind: str, payload: dict[str, Any], limits: Limits = DEFAULT_LIMITS,
                   request_id: str | None = None) -> bytes:
    """Serialize a payload already in wire form (what `encode` makes of a model's
    fields). For a sender's hot path that builds it directly; the receiver validates
    it like any other message."""
    try:
        data: bytes = msgpack.packb([VERSION, kind, payload], use_bin_type=True)
    except (OverflowError, ValueError, TypeError) as e:
        raise ProtocolError(f"cannot encode {kind}: {e}", kind=kind) from None
    if len(data) > limits.max_message_bytes:
        raise ProtocolError(
            f"{kind} message is {len(data)} bytes; the limit is {limits.max_message_bytes}",
            kind=kind,
            request_id=request_id,
        )
    return data


def encode_submits(encoded: list[bytes], limits: Limits = DEFAULT_LIMITS) -> Iterator[bytes]:
    """Encoded submits (each as `encode` makes it, within `limits`) as the fewest messages
    within `limits` and MAX_SUBMITS, in order: a lone one as itself, several as a SubmitBatch,
    built from their bytes as they are (the hot path of a burst)."""
    room = limits.max_message_bytes - _BATCH_ENVELOPE_BYTES
    start = 0
    while start < len(encoded):
        end, size = start + 1, len(encoded[start]) + _BATCH_ITEM_BYTES
        while end < len(encoded) and end - start < MAX_SUBMITS and size + len(encoded[end]) + _BATCH_ITEM_BYTES <= room:
            size += len(encoded[end]) + _BATCH_ITEM_BYTES
            end += 1
        if end - start == 1:
            yield encoded[start]
        else:
            yield msgpack.packb([VERSION, SubmitBatch.kind, {"submits": encoded[start:end]}], use_bin_type=True)
        start = end


def decode(data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS,
           budget: Unpacking | None = None) -> Message:  # fmt: skip
    """Parse and validate one message. `budget`: the packed values it may expand, where
    it shares the bound of one message with others (the submits of one SubmitBatch);
    None: its own."""
    return decode_with_payload(data, limits, budget)[0]


def decode_with_payload(data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS,
                        budget: Unpacking | None = None) -> tuple[Message, dict[str, Any]]:  # fmt: skip
    """`decode`, and the payload as it came: the message's fields in wire form (packed
    numbers as bytes), for a sender that passes the message on with a few fields changed
    (`encode_payload`) rather than encoding it again."""
    try:
        envelope = unpack(data, limits)
    except ProtocolError as e:  # over a limit or malformed: name the request if it can be told
        if not isinstance(data, bytes | bytearray | memoryview) or memoryview(data).nbytes > limits.max_message_bytes:
            raise
        raise ProtocolError(str(e), request_id=salvage_request_id(data)) from None
    if type(envelope) is not list or len(envelope) != 3:
        raise ProtocolError(f"a message must be [version, kind, payload], got {_brief(envelope)}")
    version, kind, payload = envelope
    if type(version) is not int or version != VERSION:
        raise ProtocolError(f"unsupported protocol version {_brief(version)}; this side speaks {VERSION}")
    cls = KINDS.get(kind) if type(kind) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {_brief(kind)}; known kinds: {', '.join(KINDS)}")
    if type(payload) is not dict:
        raise ProtocolError(f"{kind} payload must be a map, got {_brief(payload)}", kind=kind)
    try:
        msg = cls.model_validate(payload, context=Unpacking(limits.max_packed_values) if budget is None else budget)
    except ValidationError as e:
        raise ProtocolError(describe_invalid(kind, e), kind=kind, request_id=_request_id(payload)) from None
    return msg, payload


def unpack(data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Any:
    """msgpack bytes to plain Python values, within `limits`; no validation."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(f"a message is bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if size > limits.max_message_bytes:
        raise ProtocolError(f"message is {size} bytes; the limit is {limits.max_message_bytes}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_bin_len,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_ext_len=0,
        )
    except msgpack.ExtraData:
        raise ProtocolError("malformed msgpack: trailing bytes after the message") from None
    # msgpack signals bad input with ValueError, its own exceptions, UnicodeDecodeError,
    # TypeError and more; at this boundary all of them mean the same thing.
    except Exception as e:
        raise ProtocolError(f"malformed msgpack: {e or type(e).__name__}") from None
    _check_depth(obj, limits.max_depth)
    return obj


def _check_depth(obj: Any, max_depth: int) -> None:
    """Iterative, so a deep message cannot exhaust the Python stack."""
    level: list[Any] = [obj]
    depth = 0
    while level:
        containers = [x for x in level if type(x) is list or type(x) is dict]
        if not containers:
            return
        depth += 1
        if depth > max_depth:
            raise ProtocolError(f"message nests arrays and maps deeper than {max_depth} levels")
        level = []
        for c in containers:
            level.extend(c.values() if type(c) is dict else c)


def _request_id(payload: dict[Any, Any]) -> str | None:
    """The request an invalid message was about, if it names one usable as an id."""
    rid = payload.get("request_id")
    return rid if type(rid) is str and 0 < len(rid) <= 256 else None


def _brief(value: Any, width: int = 60) -> str:
    """A short description of untrusted input; never a deep repr, which could recurse."""
    if type(value) is list or type(value) is dict:
        n = len(value)
        return f"a {'list' if type(value) is list else 'map'} of {n} item{'' if n == 1 else 's'}"
    if type(value) is str or type(value) is bytes:
        value = value[:width]  # repr of a 16 MB string would itself cost 16-64 MB
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def describe_invalid(kind: str, error: ValidationError) -> str:
    """One line naming each field that failed validation, its rule and its value."""
    problems = []
    for item in error.errors(include_url=False)[:_MAX_ERRORS_SHOWN]:
        if item["loc"]:
            where = ".".join(str(p) for p in item["loc"])
            problems.append(f"{where}: {item['msg']} (got {_brief(item.get('input'), 40)})")
        else:  # a rule across fields: the message names them
            problems.append(str(item["msg"]).removeprefix("Value error, "))
    more = error.error_count() - _MAX_ERRORS_SHOWN
    if more > 0:
        problems.append(f"and {more} more")
    return f"invalid {kind}: " + "; ".join(problems)
