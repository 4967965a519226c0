"""The ZeroMQ client library (synchronous): talk to any of a list of gateways.

    client = Client(["tcp://gw1:5550", "tcp://gw2:5550"])
    print(client.generate("The capital of France is", max_tokens=16).text)
    for chunk in client.stream("Tell me a story", max_tokens=64, temperature=0.8, seed=1):
        print(chunk.text, end="", flush=True)
    future = client.submit("Hello", max_tokens=8); future.cancel(); future.result(timeout=5)

Thread-safe: one internal I/O thread owns the socket (see connection.py), so
one Client may be shared by many threads. Depends on pyzmq, msgpack and
pydantic only.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import protocol
from clients.connection import Connection, GatewayLostError, RequestError
from protocol import FinishReason

__all__ = [
    "Client",
    "CompletionOutput",
    "FinishReason",
    "GatewayLostError",
    "GenerationResult",
    "RequestError",
    "RequestFuture",
    "StreamChunk",
    "build_submit",
]

Prompt = str | Sequence[int]


@dataclass(slots=True)
class CompletionOutput:
    """One returned sequence."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    log_probs: list[float] | None = None
    # Per generated token, with output_config.top_n_log_probs: the likeliest tokens and their log probs.
    top_token_ids: list[list[int]] | None = None
    top_log_probs: list[list[float]] | None = None


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    outputs: list[CompletionOutput]

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """What one sequence added since the last chunk (with beam search: the best
    beam so far, whole, since beams are replaced rather than extended)."""

    request_id: str
    index: int  # sequence index
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None  # set on the sequence's last chunk
    is_final: bool  # the request's last chunk


def build_submit(
    prompt: Prompt,
    *,
    request_id: str | None = None,
    max_tokens: int = 64,
    streaming: bool = False,
    model: str | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    min_tokens: int | None = None,
    repetition_penalty: float | None = None,
    beam_width: int = 1,
    length_penalty: float | None = None,
    early_stopping: int | None = None,
    top_n_log_probs: int = 0,
    stop: Sequence[str] | None = None,
    stop_token_ids: Sequence[Sequence[int]] | None = None,
    bad_token_ids: Sequence[Sequence[int]] | None = None,
    end_id: int | None = None,
    num_return_sequences: int = 1,
    return_log_probs: bool = False,
    priority: float = 0.5,
) -> protocol.Submit:
    """A validated submit message; bad arguments raise pydantic's ValidationError,
    which names the field."""
    text = prompt if isinstance(prompt, str) else None
    fields: dict[str, Any] = {
        "request_id": request_id or uuid.uuid4().hex,
        "model": model,
        "prompt": text,
        "input_token_ids": None if text is not None else list(prompt),
        "max_tokens": max_tokens,
        "streaming": streaming,
        "sampling_config": {
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "min_p": min_p,
            "seed": seed,
            "min_tokens": min_tokens,
            "repetition_penalty": repetition_penalty,
            "beam_width": beam_width,
            "length_penalty": length_penalty,
            "early_stopping": early_stopping,
        },
        "output_config": {"return_log_probs": return_log_probs, "top_n_log_probs": top_n_log_probs},
        "stop": list(stop) if stop else None,
        "stop_words": [list(w) for w in stop_token_ids] if stop_token_ids else None,
        "bad_words": [list(w) for w in bad_token_ids] if bad_token_ids else None,
        "end_id": end_id,
        "num_return_sequences": num_return_sequences,
        "priority": priority,
    }
    return protocol.Submit.model_validate(fields)


class Accumulator:
    """Folds a request's responses into chunks and the final result."""

    def __init__(self, request_id: str, num_sequences: int, beam_search: bool = False) -> None:
        self.result = GenerationResult(request_id, [CompletionOutput(i) for i in range(num_sequences)])
        self.beam_search = beam_search

    def add(self, response: protocol.Response) -> StreamChunk:
        r = response.result
        assert r is not None
        if self.beam_search:
            return self._replace_beams(r)
        out = self.result.outputs[r.sequence_index]
        new_ids = list(r.output_token_ids[0])
        new_text = r.text[0] if r.text else ""
        out.token_ids.extend(new_ids)
        out.text += new_text
        if r.log_probs is not None:
            out.log_probs = (out.log_probs or []) + list(r.log_probs[0])
        if r.top_token_ids is not None and r.top_log_probs is not None:
            out.top_token_ids = (out.top_token_ids or []) + [list(t) for t in r.top_token_ids[0]]
            out.top_log_probs = (out.top_log_probs or []) + [list(p) for p in r.top_log_probs[0]]
        reason = r.finish_reasons[0] if r.is_sequence_final or r.is_final else None
        if reason is not None:
            out.finish_reason = FinishReason(reason)
        return StreamChunk(
            self.result.request_id,
            r.sequence_index,
            new_ids,
            new_text,
            out.finish_reason if reason is not None else None,
            r.is_final,
        )

    def _replace_beams(self, r: protocol.Result) -> StreamChunk:
        """Beam search sends whole beams each time (the best ones, best first): each
        output is replaced, and the chunk carries the best beam as it stands."""
        outputs = []
        for i, tokens in enumerate(r.output_token_ids):
            out = CompletionOutput(i, list(tokens), r.text[i] if r.text else "")
            if r.is_final:
                out.finish_reason = FinishReason(r.finish_reasons[i])
            if r.log_probs is not None:
                out.log_probs = list(r.log_probs[i])
            outputs.append(out)
        self.result.outputs = outputs
        best = outputs[0]
        return StreamChunk(self.result.request_id, 0, best.token_ids, best.text, best.finish_reason, r.is_final)


class RequestFuture:
    """One request in flight: `.result(timeout)`, `.cancel()`, and, for a streaming
    request, iteration over its chunks."""

    def __init__(self, connection: Connection, msg: protocol.Submit) -> None:
        self.request_id = msg.request_id
        self._connection = connection
        self._cond = threading.Condition()
        self._acc = Accumulator(msg.request_id, msg.num_return_sequences, msg.sampling_config.beam_width > 1)
        self._chunks: deque[StreamChunk] = deque()
        self._keep_chunks = msg.streaming
        self._done = False
        self._error: RequestError | None = None

    # Sink, called on the I/O thread.
    def on_response(self, response: protocol.Response) -> None:
        with self._cond:
            chunk = self._acc.add(response)
            if self._keep_chunks:
                self._chunks.append(chunk)
            self._done = response.is_final
            self._cond.notify_all()

    def on_error(self, error: RequestError) -> None:
        with self._cond:
            self._error = error
            self._done = True
            self._cond.notify_all()

    def done(self) -> bool:
        with self._cond:
            return self._done

    def result(self, timeout: float | None = None) -> GenerationResult:
        """The final result; raises RequestError (or GatewayLostError) if the request
        failed, TimeoutError if it is still running after `timeout` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.request_id} still running after {timeout} s")
            if self._error is not None:
                raise self._error
            return self._acc.result

    def cancel(self) -> None:
        """Ask the service to stop the request; it ends with finish reason CANCELLED
        (the result says which tokens were produced before)."""
        self._connection.cancel(self.request_id)

    def __iter__(self) -> Iterator[StreamChunk]:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._chunks) or self._done)
                chunks = list(self._chunks)
                self._chunks.clear()
                done, error = self._done, self._error
            yield from chunks
            if done:
                if error is not None:
                    raise error
                return


class Client:
    def __init__(
        self, gateways: Sequence[str], *, heartbeat_interval_s: float = 1.0, missed_heartbeats: int = 3
    ) -> None:
        self._connection = Connection(
            gateways, heartbeat_interval_s=heartbeat_interval_s, missed_heartbeats=missed_heartbeats
        )

    @property
    def gateway(self) -> str | None:
        """The gateway in use now."""
        return self._connection.gateway

    def submit(self, prompt: Prompt, **kwargs: Any) -> RequestFuture:
        """Start a request (text or token ids); keyword arguments as in build_submit."""
        msg = build_submit(prompt, **kwargs)
        future = RequestFuture(self._connection, msg)
        self._connection.submit(msg.request_id, protocol.encode(msg), future)
        return future

    def generate(self, prompt: Prompt, timeout: float | None = None, **kwargs: Any) -> GenerationResult:
        return self.submit(prompt, **kwargs).result(timeout)

    def stream(self, prompt: Prompt, **kwargs: Any) -> RequestFuture:
        """A streaming request: iterate it for StreamChunks, or call .result()."""
        return self.submit(prompt, streaming=True, **kwargs)

    def close(self) -> None:
        self._connection.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
