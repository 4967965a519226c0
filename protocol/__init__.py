"""tokenwire's wire format, version 1: message models, the msgpack codec, its
limits, and the names of Redis keys. Imports nothing else of tokenwire."""

from protocol.base import Message, WireModel
from protocol.codec import KINDS, VERSION, decode, describe_invalid, encode, encode_payload, unpack
from protocol.control import (
    Cancel,
    Drain,
    ErrorCode,
    ErrorReply,
    Heartbeat,
    Hello,
    LoraAdapters,
    LoraLoad,
    LoraUnload,
    Ready,
)
from protocol.errors import ProtocolError
from protocol.keys import CANCEL_TTL_S, DEFAULT_PREFIX, Keys
from protocol.kv_cache import KvEvents, KvSnapshot, KvSnapshotRequest
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.records import IterationStats, RequestStats, WorkerInfo, WorkerLoad
from protocol.request import (
    ChatMessage,
    GuidedDecodingParams,
    LoraConfig,
    OutputConfig,
    PromptTuningConfig,
    SamplingConfig,
    SpeculativeConfig,
    Submit,
)
from protocol.results import FinishReason, Logits, Response, Result, ResultBatch, StreamedTokens

__all__ = [
    "CANCEL_TTL_S",
    "DEFAULT_LIMITS",
    "DEFAULT_PREFIX",
    "KINDS",
    "VERSION",
    "Cancel",
    "ChatMessage",
    "Drain",
    "ErrorCode",
    "ErrorReply",
    "FinishReason",
    "GuidedDecodingParams",
    "Heartbeat",
    "Hello",
    "IterationStats",
    "Keys",
    "KvEvents",
    "KvSnapshot",
    "KvSnapshotRequest",
    "Limits",
    "Logits",
    "LoraAdapters",
    "LoraConfig",
    "LoraLoad",
    "LoraUnload",
    "Message",
    "OutputConfig",
    "PromptTuningConfig",
    "ProtocolError",
    "Ready",
    "RequestStats",
    "Response",
    "Result",
    "ResultBatch",
    "SamplingConfig",
    "SpeculativeConfig",
    "StreamedTokens",
    "Submit",
    "WireModel",
    "WorkerInfo",
    "WorkerLoad",
    "decode",
    "describe_invalid",
    "encode",
    "encode_payload",
    "unpack",
]
