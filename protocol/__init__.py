"""tokenwire's wire format, version 1: message models, the msgpack codec, its
limits, and the names of Redis keys. Imports nothing else of tokenwire.

The names below load on first use (PEP 562), so that the pure-data modules —
`protocol.options` (the request options), `protocol.status` (finish reasons,
request states), `protocol.stats` (iteration and request stats) and
`protocol.model_fit` (vocabulary and context rules), `protocol.block_hash` (the
KV block hashes both sides compute), `protocol.continuation` (which requests a
continuation can carry) — can be imported where
pydantic and msgpack are not installed: the executor on a GPU host, and
`clients.params`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from protocol.base import Message as Message
    from protocol.base import WireModel as WireModel
    from protocol.codec import KINDS as KINDS
    from protocol.codec import VERSION as VERSION
    from protocol.codec import decode as decode
    from protocol.codec import decode_with_payload as decode_with_payload
    from protocol.codec import describe_invalid as describe_invalid
    from protocol.codec import encode as encode
    from protocol.codec import encode_payload as encode_payload
    from protocol.codec import encode_submits as encode_submits
    from protocol.codec import unpack as unpack
    from protocol.control import Cancel as Cancel
    from protocol.control import Drain as Drain
    from protocol.control import ErrorCode as ErrorCode
    from protocol.control import ErrorReply as ErrorReply
    from protocol.control import Heartbeat as Heartbeat
    from protocol.control import Hello as Hello
    from protocol.control import LoraAdapters as LoraAdapters
    from protocol.control import LoraLoad as LoraLoad
    from protocol.control import LoraUnload as LoraUnload
    from protocol.control import Ready as Ready
    from protocol.errors import ProtocolError as ProtocolError
    from protocol.keys import CANCEL_TTL_S as CANCEL_TTL_S
    from protocol.keys import DEFAULT_PREFIX as DEFAULT_PREFIX
    from protocol.keys import Keys as Keys
    from protocol.kv_cache import KvEvents as KvEvents
    from protocol.kv_cache import KvSnapshot as KvSnapshot
    from protocol.kv_cache import KvSnapshotRequest as KvSnapshotRequest
    from protocol.kv_transfer import KV_FORMAT as KV_FORMAT
    from protocol.kv_transfer import CudaIpcBuffer as CudaIpcBuffer
    from protocol.kv_transfer import HandedOff as HandedOff
    from protocol.kv_transfer import KvAck as KvAck
    from protocol.kv_transfer import KvHandoff as KvHandoff
    from protocol.kv_transfer import KvTransfer as KvTransfer
    from protocol.limits import DEFAULT_LIMITS as DEFAULT_LIMITS
    from protocol.limits import Limits as Limits
    from protocol.records import IterationStats as IterationStats
    from protocol.records import RequestStats as RequestStats
    from protocol.records import WorkerInfo as WorkerInfo
    from protocol.records import WorkerLoad as WorkerLoad
    from protocol.request import ChatMessage as ChatMessage
    from protocol.request import EmbeddingConfig as EmbeddingConfig
    from protocol.request import GuidedDecodingParams as GuidedDecodingParams
    from protocol.request import LoraConfig as LoraConfig
    from protocol.request import OutputConfig as OutputConfig
    from protocol.request import PromptTuningConfig as PromptTuningConfig
    from protocol.request import SamplingConfig as SamplingConfig
    from protocol.request import SpeculativeConfig as SpeculativeConfig
    from protocol.request import Submit as Submit
    from protocol.request import ToolSpec as ToolSpec
    from protocol.results import FunctionCall as FunctionCall
    from protocol.results import Logits as Logits
    from protocol.results import PromptLogProbs as PromptLogProbs
    from protocol.results import Response as Response
    from protocol.results import Result as Result
    from protocol.results import ResultBatch as ResultBatch
    from protocol.results import StreamedTokens as StreamedTokens
    from protocol.status import FinishReason as FinishReason
    from protocol.submit_batch import SubmitBatch as SubmitBatch

# name -> the module that defines it
_HOME = {
    **dict.fromkeys(["Message", "WireModel"], "base"),
    **dict.fromkeys(["KINDS", "VERSION", "decode", "decode_with_payload", "describe_invalid", "encode",
                     "encode_payload", "encode_submits", "unpack"], "codec"),
    **dict.fromkeys(["Cancel", "Drain", "ErrorCode", "ErrorReply", "Heartbeat", "Hello", "LoraAdapters", "LoraLoad",
                     "LoraUnload", "Ready"], "control"),
    "ProtocolError": "errors",
    **dict.fromkeys(["CANCEL_TTL_S", "DEFAULT_PREFIX", "Keys"], "keys"),
    **dict.fromkeys(["KvEvents", "KvSnapshot", "KvSnapshotRequest"], "kv_cache"),
    **dict.fromkeys(["KV_FORMAT", "CudaIpcBuffer", "HandedOff", "KvAck", "KvHandoff", "KvTransfer"], "kv_transfer"),
    **dict.fromkeys(["DEFAULT_LIMITS", "Limits"], "limits"),
    **dict.fromkeys(["IterationStats", "RequestStats", "WorkerInfo", "WorkerLoad"], "records"),
    **dict.fromkeys(["ChatMessage", "EmbeddingConfig", "GuidedDecodingParams", "LoraConfig", "OutputConfig",
                     "PromptTuningConfig", "SamplingConfig", "SpeculativeConfig", "Submit", "ToolSpec"], "request"),
    **dict.fromkeys(["FunctionCall", "Logits", "PromptLogProbs", "Response", "Result", "ResultBatch",
                     "StreamedTokens"], "results"),
    "FinishReason": "status",
    "SubmitBatch": "submit_batch",
}  # fmt: skip

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'protocol' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"protocol.{_HOME[name]}"), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
