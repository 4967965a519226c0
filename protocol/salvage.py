"""The request a rejected message was about, read without building the message.

A message over a limit (a 5 MB prompt, 5,000 stop strings) is refused before it is
parsed, yet its sender waits for an answer about that request: the error must name
it. This reads only the envelope's headers and the `request_id` field; everything
else is skipped, not built, so the limits that refused the message still bound the
memory this uses.
"""

from __future__ import annotations

import msgpack

_MAX_ID_LEN = 256  # as protocol.codec accepts for an error's request id
_MAX_FIELDS = 64


def salvage_request_id(data: bytes | bytearray | memoryview) -> str | None:
    """The `request_id` of a `[version, kind, {...}]` message, or None."""
    reader = msgpack.Unpacker(
        max_buffer_size=max(1, memoryview(data).nbytes),
        raw=False,
        max_str_len=_MAX_ID_LEN,
        max_bin_len=_MAX_ID_LEN,
        max_array_len=_MAX_FIELDS,
        max_map_len=_MAX_FIELDS,
        max_ext_len=0,
    )
    try:
        reader.feed(data)
        if reader.read_array_header() != 3:
            return None
        reader.skip()  # version
        reader.skip()  # kind
        for _ in range(min(reader.read_map_header(), _MAX_FIELDS)):
            key = reader.unpack()
            if key == "request_id":
                value = reader.unpack()
                return value if type(value) is str and 0 < len(value) <= _MAX_ID_LEN else None
            reader.skip()  # skipping reads headers only: a long string or deep array is not built
    except Exception:  # malformed in any of msgpack's ways: there is no id to salvage
        return None
    return None
