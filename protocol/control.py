"""Messages that steer a connection rather than carry tokens."""

from __future__ import annotations

import enum
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from protocol.base import Message, Name
from protocol.records import WorkerLoad


class Cancel(Message):
    """Stop a request; it ends with a final response whose finish reason is CANCELLED."""

    kind: ClassVar[str] = "cancel"

    request_id: Name


class ErrorCode(enum.StrEnum):
    PROTOCOL = "protocol"  # the message could not be decoded or validated
    INVALID_REQUEST = "invalid_request"  # well-formed, but not servable (e.g. token id out of vocabulary)
    UNKNOWN_MODEL = "unknown_model"
    OVERLOADED = "overloaded"
    UNAVAILABLE = "unavailable"  # no worker, or the worker serving it was lost
    DRAINING = "draining"
    INTERNAL = "internal"
    UNAUTHORIZED = "unauthorized"  # no API key, or one the gateway does not accept (CURVE off)
    RATE_LIMITED = "rate_limited"  # the API key is over one of its limits; retry later


class ErrorReply(Message):
    """A failure. With `request_id` it is that request's final response; without,
    it concerns the message or connection as a whole."""

    kind: ClassVar[str] = "error"

    code: ErrorCode = Field(strict=False)
    message: str
    request_id: Name | None = None
    # From a worker: it ended the request for its own reason (its engine failed, its drain
    # ran out of time), not the request's, so another worker can carry it on.
    worker_ended: bool = False


class Heartbeat(Message):
    """Sent both ways on every data connection; a worker includes its load."""

    kind: ClassVar[str] = "heartbeat"

    sender_id: Name
    load: WorkerLoad | None = None


class Hello(Message):
    """First message on a new connection, from the connecting side."""

    kind: ClassVar[str] = "hello"

    sender_id: Name
    role: Literal["client", "gateway"]
    heartbeat_interval_s: float = Field(gt=0.0)
    # A client's API key, where its gateway asks for one (API keys on, CURVE off).
    api_key: str | None = Field(default=None, min_length=1, max_length=256)


class Ready(Message):
    """The answer to Hello: the peer is up and says what it serves."""

    kind: ClassVar[str] = "ready"

    sender_id: Name
    role: Literal["gateway", "worker"]
    heartbeat_interval_s: float = Field(gt=0.0)
    models: list[Name] = Field(default_factory=list)
    vocab_size: int | None = Field(None, ge=1)
    max_seq_len: int | None = Field(None, ge=1)  # prompt + generated tokens
    load: WorkerLoad | None = None
    # A worker's model's tokenizer, as the `tokenizers` library's JSON (UTF-8): a
    # gateway tokenizes and detokenizes with it and needs no copy of the checkpoint.
    tokenizer_json: bytes | None = None
    # How the worker's model is quantized ("compressed-tensors fp8 (...)", "int4 (quantized
    # on load, int4 RTN)", ...); None: float weights.
    quantization: str | None = None
    # Its chat template (Jinja, as Hugging Face's tokenizer_config.json holds it) and the
    # special tokens templates name: a gateway renders chat messages with them.
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    # The LoRA adapters a worker holds (requests name them in lora_config), and those it
    # does not hold but can load on a request's demand (its --lora-dir); a LoraAdapters
    # message says when either changes.
    lora_adapters: list[Name] = Field(default_factory=list)
    lora_loadable: list[Name] = Field(default_factory=list)
    # A worker that takes SubmitBatch messages (protocol/submit_batch.py); to one that does
    # not (an older worker), a gateway sends submits one by one.
    submit_batches: bool = False


class Drain(Message):
    """The sender stops taking new requests and finishes what it has; `deadline_s`
    bounds how long in-flight work may still take."""

    kind: ClassVar[str] = "drain"

    sender_id: Name
    deadline_s: float | None = Field(None, ge=0.0)


class LoraLoad(Message):
    """Register a LoRA adapter on the worker that receives it: `path` is a Hugging Face
    PEFT directory on the worker's host. Answered by LoraAdapters with this `request_id`,
    or an ErrorReply with it saying what is wrong with the adapter."""

    kind: ClassVar[str] = "lora_load"

    request_id: Name  # names the answer
    name: Name
    path: Annotated[str, Field(min_length=1, max_length=4096)]


class LoraUnload(Message):
    """Forget a LoRA adapter; requests naming it afterwards fail. Answered as LoraLoad."""

    kind: ClassVar[str] = "lora_unload"

    request_id: Name
    name: Name


class LoraAdapters(Message):
    """The LoRA adapters a worker holds now, and those it can load when a request names
    one: to every gateway when they change, and (with `request_id`) to the sender of a
    LoraLoad or LoraUnload, as its answer."""

    kind: ClassVar[str] = "lora_adapters"

    sender_id: Name
    adapters: list[Name] = Field(default_factory=list)
    loadable: list[Name] = Field(default_factory=list)
    request_id: Name | None = None
