"""OpenAI's embeddings API in tokenwire's terms: the request body, its inputs as
token ids, one `protocol.Submit` per input asking for the embedding, and the
response built from the workers' vectors.

No I/O here (gateway/http_front.py serves it). The vector is the worker's: the
model's final hidden state, pooled and at unit L2 norm (worker/executor/embeddings.py).
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

import protocol
from gateway.openai_api import ApiError
from protocol.request import Pooling

# OpenAI's own limit on the inputs of one request; each is a request to a worker.
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    """OpenAI's body, and tokenwire's one option: `pooling` ("last" | "mean"; None: the
    model's own). Unknown fields are refused, so a misspelt option is not silently ignored."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # accepted for compatibility; nothing is done with it
    pooling: Pooling | None = None

    def inputs(self) -> list[str | list[int]]:
        """Each input as text or token ids; ApiError (400) for an empty one."""
        raw = self.input
        if isinstance(raw, str):
            items: list[str | list[int]] = [raw]
        elif raw and all(isinstance(x, int) for x in raw):
            items = [list(raw)]  # type: ignore[arg-type]  # one input given as token ids
        else:
            items = list(raw)  # type: ignore[arg-type]
        if not items:
            raise _bad("input must not be empty")
        if len(items) > MAX_INPUTS:
            raise _bad(f"input has {len(items)} entries; at most {MAX_INPUTS} are allowed")
        for i, item in enumerate(items):
            if len(item) == 0:
                raise _bad(f"input[{i}] is empty: " + ("an empty string" if isinstance(item, str) else "no tokens"),
                           f"input[{i}]")  # fmt: skip
        return items


def _bad(message: str, param: str = "input") -> ApiError:
    return ApiError(400, message, "invalid_request_error", "invalid_value", param)


def check_tokens(ids: list[int], index: int, max_seq_len: int | None, vocab_size: int | None) -> None:
    """ApiError (400) when input `index`'s tokens do not fit the model."""
    param = f"input[{index}]"
    if max_seq_len is not None and len(ids) > max_seq_len:
        raise _bad(f"{param} is {len(ids)} tokens; the model's context is {max_seq_len} tokens", param)
    if vocab_size is not None:
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise _bad(f"{param}: token id {bad} is outside the vocabulary [0, {vocab_size})", param)


def submit_for(request_id: str, model: str | None, ids: list[int], pooling: Pooling | None) -> protocol.Submit:
    # max_tokens is the wire's required field; an embedding request generates nothing.
    return protocol.Submit(request_id=request_id, model=model, input_token_ids=ids, max_tokens=1,
                           embedding_config=protocol.EmbeddingConfig(pooling=pooling))  # fmt: skip


def vector_of(result: protocol.Result, dimensions: int | None) -> np.ndarray:
    """The result's embedding as float32; with `dimensions`, its first values at unit norm
    again (how Matryoshka-trained models are shortened)."""
    if result.embedding is None:
        raise ApiError(500, "the worker answered without an embedding", "server_error")
    vector = np.frombuffer(result.embedding.data, dtype="<f4").astype(np.float32)
    if dimensions is None:
        return vector
    if dimensions > vector.shape[0]:
        raise _bad(f"dimensions ({dimensions}) exceeds the model's embedding size ({vector.shape[0]})", "dimensions")
    short = vector[:dimensions].astype(np.float64)
    norm = float(np.linalg.norm(short))
    return (short / norm if norm > 0 else short).astype(np.float32)


def response(model: str, vectors: list[np.ndarray], encoding_format: str, prompt_tokens: int) -> dict[str, Any]:
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, encoding_format)}
            for i, v in enumerate(vectors)]  # fmt: skip
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}  # fmt: skip


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: the little-endian float32 bytes
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
