"""The ZeroMQ client library for asyncio; the same I/O thread as `Client`.

async with AsyncClient(["tcp://127.0.0.1:5550"]) as client:
    result = await client.generate("Hello", max_tokens=8)
    async for chunk in client.stream("Hello", SamplingParams(max_tokens=8)):
        print(chunk.text, end="")

Requests take what `Client`'s do: a SamplingParams, its fields as keywords, or both.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import protocol
from clients.connection import Connection, RequestError
from clients.params import RequestOutput, SamplingParams, StreamChunk
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

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from protocol.request import Pooling

_END = object()


class _Hop:
    """Calls from the I/O thread run on one event loop, in order, with one wake-up of
    the loop per burst: a result batch for 64 streams costs one, not 64."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[Any], None], Any]] = []

    def call(self, fn: Callable[[Any], None], arg: Any) -> None:
        with self._lock:
            self._pending.append((fn, arg))
            if len(self._pending) > 1:
                return  # a wake-up is on its way
        self.loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for fn, arg in pending:
            fn(arg)


class AsyncRequest:
    """One request in flight: `await .result()`, `.cancel()`, `async for` its chunks."""

    def __init__(self, connection: Connection, msg: protocol.Submit, hop: _Hop) -> None:
        self.request_id = msg.request_id
        self._connection = connection
        self._hop = hop
        self._acc = Accumulator.for_submit(msg)
        self._chunks: asyncio.Queue[StreamChunk | object] = asyncio.Queue()
        self._future: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()

    # Sink, called on the I/O thread: hop to the event loop.
    def on_response(self, response: protocol.Response) -> None:
        self._hop.call(self._apply, response)

    def on_error(self, error: RequestError) -> None:
        self._hop.call(self._fail, error)

    def _apply(self, response: protocol.Response) -> None:
        self._chunks.put_nowait(self._acc.add(response))
        if response.is_final:
            self._chunks.put_nowait(_END)
            if not self._future.done():
                self._future.set_result(self._acc.result)

    def _fail(self, error: RequestError) -> None:
        self._chunks.put_nowait(_END)
        if not self._future.done():
            self._future.set_exception(error)

    async def result(self, timeout: float | None = None) -> RequestOutput:
        return await asyncio.wait_for(asyncio.shield(self._future), timeout)

    def cancel(self) -> None:
        self._connection.cancel(self.request_id)

    async def __aiter__(self) -> AsyncIterator[StreamChunk]:
        while True:
            item = await self._chunks.get()
            if item is _END:
                if self._future.done() and self._future.exception() is not None:
                    raise self._future.exception()  # type: ignore[misc]
                return
            assert isinstance(item, StreamChunk)
            yield item


class AsyncClient:
    def __init__(
        self,
        gateways: Sequence[str],
        *,
        heartbeat_interval_s: float = 1.0,
        missed_heartbeats: int = 3,
        curve: ClientCurve | None = None,
        api_key: str | None = None,
    ) -> None:
        self._connection = Connection(
            gateways, heartbeat_interval_s=heartbeat_interval_s, missed_heartbeats=missed_heartbeats, curve=curve,
            api_key=api_key,
        )
        self._hop: _Hop | None = None  # for the loop of the latest submit; requests keep their own

    def submit(self, prompt: Prompt | None, params: SamplingParams | None = None, /, **options: Any) -> AsyncRequest:
        """Start a request from a coroutine; arguments as in Client.submit."""
        return self._start(submit_from_call(prompt, params, options))

    def _start(self, msg: protocol.Submit) -> AsyncRequest:
        loop = asyncio.get_running_loop()
        if self._hop is None or self._hop.loop is not loop:
            self._hop = _Hop(loop)
        request = AsyncRequest(self._connection, msg, self._hop)
        self._connection.submit(msg, encode_submit(msg), request)
        return request

    async def embed(self, inputs: Prompt | Sequence[Prompt], /, *, pooling: Pooling | None = None,
                    model: str | None = None, timeout: float | None = None
                    ) -> list[npt.NDArray[np.float32]]:  # fmt: skip
        """Each input's embedding, in order; arguments as in Client.embed."""
        requests = [self._start(embedding_submit(p, pooling, model)) for p in as_batch(inputs)]
        return [embedding_of(await r.result(timeout)) for r in requests]

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, /, *, timeout: float | None = None, **kwargs: Any
    ) -> RequestOutput:
        return await self.submit(prompt, params, **kwargs).result(timeout)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, /, **kwargs: Any) -> AsyncRequest:
        return self.submit(prompt, params, streaming=True, **kwargs)

    async def chat(self, messages: Messages, params: SamplingParams | None = None, /, *,
                   timeout: float | None = None, **kwargs: Any) -> RequestOutput:  # fmt: skip
        """A chat's reply; arguments as in Client.chat (tools included)."""
        return await self.submit(None, params, messages=messages, **kwargs).result(timeout)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._connection.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
