"""The ZeroMQ client library (synchronous): talk to any of a list of gateways.

    client = Client(["tcp://gw1:5550", "tcp://gw2:5550"])
    print(client.generate("The capital of France is", max_tokens=16).text)
    for chunk in client.stream("Tell me a story", SamplingParams(max_tokens=64, temperature=0.8, seed=1)):
        print(chunk.text, end="", flush=True)
    print(client.chat([{"role": "user", "content": "What is the capital of France?"}]).text)
    future = client.submit("Hello", max_tokens=8); future.cancel(); future.result(timeout=5)

Every request takes a SamplingParams (clients/params.py), or its fields as
keyword arguments, or both (the keywords win). Thread-safe: one internal I/O
thread owns the socket (see connection.py), so one Client may be shared by many
threads. Depends on pyzmq, msgpack and pydantic only.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import protocol
from clients.connection import Connection, GatewayLostError, GatewayUnavailableError, RequestError
from clients.params import CompletionOutput, RequestOutput, SamplingParams, Speculation, StreamChunk
from clients.wire import (
    Accumulator,
    Messages,
    Prompt,
    as_batch,
    embedding_of,
    embedding_submit,
    encode_submit,
    submit_from_call,
)
from ops.curve import ClientCurve
from protocol import FinishReason

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from protocol.request import Pooling

__all__ = [
    "Client",
    "CompletionOutput",
    "FinishReason",
    "GatewayLostError",
    "GatewayUnavailableError",
    "RequestError",
    "RequestFuture",
    "RequestOutput",
    "SamplingParams",
    "Speculation",
    "StreamChunk",
]


class RequestFuture:
    """One request in flight: `.result(timeout)`, `.cancel()`, and, for a streaming
    request, iteration over its chunks."""

    def __init__(self, connection: Connection, msg: protocol.Submit) -> None:
        self.request_id = msg.request_id
        self._connection = connection
        self._cond = threading.Condition()
        self._acc = Accumulator.for_submit(msg)
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

    def result(self, timeout: float | None = None) -> RequestOutput:
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
        return self.chunks()

    def chunks(self, timeout: float | None = None) -> Iterator[StreamChunk]:
        """The stream's chunks; TimeoutError if it is still running after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._cond.wait_for(lambda: bool(self._chunks) or self._done, left):
                    raise TimeoutError(f"request {self.request_id} still running after {timeout} s")
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
        self,
        gateways: Sequence[str],
        *,
        heartbeat_interval_s: float = 1.0,
        missed_heartbeats: int = 3,
        connect_timeout_s: float = 2.0,
        connect_attempts: int = 2,
        curve: ClientCurve | None = None,
        api_key: str | None = None,
    ) -> None:
        """A request fails with GatewayUnavailableError (naming the addresses) when no
        gateway answered within `connect_timeout_s`, `connect_attempts` times each."""
        self._connection = Connection(
            gateways,
            heartbeat_interval_s=heartbeat_interval_s,
            missed_heartbeats=missed_heartbeats,
            connect_timeout_s=connect_timeout_s,
            connect_attempts=connect_attempts,
            curve=curve,
            api_key=api_key,
        )

    @property
    def gateway(self) -> str | None:
        """The gateway in use now."""
        return self._connection.gateway

    def submit(self, prompt: Prompt | None, params: SamplingParams | None = None, /, **options: Any) -> RequestFuture:
        """Start a request (text or token ids). `options`: `request_id` (default: a
        random one), `model` (default: the service's), `streaming`, `messages` (a chat,
        with prompt None), and SamplingParams
        fields, over `params`. Bad options raise (ValueError naming the field, or
        TypeError for an unknown one) before anything is sent."""
        return self._start(submit_from_call(prompt, params, options))

    def _start(self, msg: protocol.Submit) -> RequestFuture:
        future = RequestFuture(self._connection, msg)
        self._connection.submit(msg, encode_submit(msg), future)
        return future

    def embed(self, inputs: Prompt | Sequence[Prompt], /, *, pooling: Pooling | None = None, model: str | None = None,
              timeout: float | None = None) -> list[npt.NDArray[np.float32]]:  # fmt: skip
        """The embedding of each input (text or token ids), in order: the model's final
        hidden state pooled over the input ("last" token or "mean"; None: the model's own)
        at unit length, as /v1/embeddings gives it. All are sent at once."""
        futures = [self._start(embedding_submit(p, pooling, model)) for p in as_batch(inputs)]
        return [embedding_of(f.result(timeout)) for f in futures]

    def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, /, *, timeout: float | None = None, **kwargs: Any
    ) -> RequestOutput:
        """The whole result; keyword arguments as in submit."""
        return self.submit(prompt, params, **kwargs).result(timeout)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, /, **kwargs: Any) -> RequestFuture:
        """A streaming request: iterate it for StreamChunks, or call .result()."""
        return self.submit(prompt, params, streaming=True, **kwargs)

    def chat(self, messages: Messages, params: SamplingParams | None = None, /, *, timeout: float | None = None,
             **kwargs: Any) -> RequestOutput:  # fmt: skip
        """A chat's reply: `messages` (dicts with role and content, as OpenAI's API takes
        them) rendered by the gateway with the model's chat template; keyword arguments as
        in submit, and `tools` (OpenAI's entries), `tool_choice` ("none", "auto",
        "required" or a tool's name: a forced call, guided to the tools' schemas) and
        `parallel_tool_calls`: the calls come back in the output's `tool_calls`."""
        return self.submit(None, params, messages=messages, **kwargs).result(timeout)

    def close(self) -> None:
        self._connection.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
