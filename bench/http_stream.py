"""One streamed /v1/completions request over a raw connection, timed token by token: what
the HTTP rows of the service benches send (no HTTP client library: the GPU host has none,
and one would add its own cost to the path measured)."""

from __future__ import annotations

import asyncio
import json
import time

from bench.stream_timing import Timeline


async def stream_completion(port: int, model: str, prompt: list[int], output: int, line: Timeline | None, *,
                            greedy: bool, key: str | None = None) -> None:  # fmt: skip
    """Each SSE chunk carries one step's text (one token while decoding); the stream's token
    count is its usage's. With `key`, the request sends it as its bearer token."""
    auth = b"" if key is None else b"Authorization: Bearer %s\r\n" % key.encode()
    body = {"model": model, "prompt": prompt, "max_tokens": output, "min_tokens": output, "stream": True,
            "stream_options": {"include_usage": True}, **({"temperature": 0.0} if greedy else {})}  # fmt: skip
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n%s"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (auth, len(payload), payload))  # fmt: skip
    status = await reader.readline()
    assert b" 200 " in status, status + await reader.read()
    while (await reader.readline()).strip():
        pass  # headers; the body is chunked, its chunk sizes are skipped as non-data lines
    chunks = usage = 0
    async for raw in reader:
        if not raw.startswith(b"data: {"):
            continue
        if b'"usage":{' in raw:
            usage = json.loads(raw[6:])["usage"]["completion_tokens"]
        elif line is not None:
            line.add(time.perf_counter(), 1)
            chunks += 1
    writer.close()
    if line is not None and usage != chunks:  # a chunk carried several tokens: count them as the usage says
        line.tokens = usage
