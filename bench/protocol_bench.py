"""Encode and decode throughput of the wire format, for the messages that matter:
a submit, a single-token streaming result, and a 64-request result batch, whole
and as workers and gateways send it (the streamed steps in columns; a gateway
reads the columns as they are, a client expands them into Responses with their
text, which the last row's decode includes)."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import protocol as p

TITLE = "protocol: encode / decode (validating), one core"
MIN_SECONDS = 0.3  # per measurement


def submit() -> p.Message:
    return p.Submit(
        request_id="client-7f3a:000123",
        model="default",
        input_token_ids=list(range(1000, 1512)),
        max_tokens=256,
        streaming=True,
        sampling_config=p.SamplingConfig(temperature=0.7, top_p=0.9, seed=42),
        stop_words=[[13, 13]],
    )


def result_batch(n: int) -> p.Message:
    responses = [
        p.Response(
            request_id=f"client-7f3a:{i:06d}",
            result=p.Result(
                is_final=False, output_token_ids=[[1000 + i]], finish_reasons=[p.FinishReason.NOT_FINISHED]
            ),
        )
        for i in range(n)
    ]
    load = p.WorkerLoad(num_queued_requests=3, num_active_requests=n, free_num_blocks=812, max_num_blocks=4096)
    return p.ResultBatch(responses=responses, load=load)


def streamed_batch(n: int, text: bool = False) -> p.Message:
    columns = p.StreamedTokens(
        request_ids=[f"client-7f3a:{i:06d}" for i in range(n)],
        counts=[1] * n,
        token_ids=[1000 + i for i in range(n)],
        text=[" word"] * n if text else None,
    )
    if text:  # a gateway's, to one client
        return p.ResultBatch(streamed=columns)
    load = p.WorkerLoad(num_queued_requests=3, num_active_requests=n, free_num_blocks=812, max_num_blocks=4096)
    return p.ResultBatch(streamed=columns, load=load)


def _decode_all(wire: bytes) -> object:
    msg = p.decode(wire)
    assert isinstance(msg, p.ResultBatch)
    return msg.all_responses()


def per_call_seconds(fn: Callable[[], object]) -> float:
    """Best of five timed runs, each at least MIN_SECONDS / 5 long."""
    fn()
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if time.perf_counter() - start >= MIN_SECONDS / 5:
            break
        calls *= 2
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def table() -> tuple[list[str], list[list[str]]]:
    cases: list[tuple[str, p.Message, int, Callable[[bytes], object]]] = [
        ("submit (512 token ids)", submit(), 1, p.decode),
        ("result, 1 token", result_batch(1), 1, p.decode),
        ("result batch, 64 requests", result_batch(64), 64, p.decode),
        ("result batch, 64 streamed steps in columns (worker)", streamed_batch(64), 64, p.decode),
        ("... with text, to Responses (client)", streamed_batch(64, text=True), 64, _decode_all),
    ]
    header = ["message", "bytes", "encode µs", "decode µs", "encode msg/s", "decode msg/s", "decode µs/resp"]
    rows = []
    for name, msg, responses, decode in cases:
        wire = p.encode(msg)
        assert p.decode(wire) == msg
        enc = per_call_seconds(partial(p.encode, msg))
        dec = per_call_seconds(partial(decode, wire))
        rows.append(
            [
                name,
                str(len(wire)),
                f"{enc * 1e6:.1f}",
                f"{dec * 1e6:.1f}",
                f"{1 / enc:,.0f}",
                f"{1 / dec:,.0f}",
                f"{dec * 1e6 / responses:.2f}",
            ]
        )
    return header, rows
