"""What every wire model shares: strict types, no unknown fields, finite numbers."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field

# Ids and names: request ids, sender ids, model names, addresses.
Name = Annotated[str, Field(min_length=1, max_length=256)]
# Client-chosen integer tags: uint64, as the executor's ids.
Uint64 = Annotated[int, Field(ge=0, le=2**64 - 1)]


class WireModel(BaseModel):
    # strict: msgpack already gives real ints, floats, bools and strings, so a
    # "5" for max_tokens or a 1 for a flag is a client bug worth reporting.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class Message(WireModel):
    """A top-level message; `kind` names it in the envelope."""

    kind: ClassVar[str]
