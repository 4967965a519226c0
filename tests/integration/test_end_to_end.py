"""200 concurrent streaming requests through 2 gateways and 2 workers (real
processes, Redis and loopback sockets), checked message by message."""

from __future__ import annotations

import random

import protocol
from tests.integration.wire import WireClient
from tests.procs import stack

NUM_REQUESTS = 200


def _submits(streaming: bool) -> list[protocol.Submit]:
    rng = random.Random(7)
    out = []
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(5, 320) for _ in range(rng.randrange(3, 40))]
        out.append(protocol.Submit(
            request_id=f"req-{i}-{'s' if streaming else 'n'}",
            input_token_ids=prompt,
            max_tokens=rng.randrange(4, 24),
            streaming=streaming,
            sampling_config=protocol.SamplingConfig(temperature=0.9, top_k=40, seed=1000 + i),
        ))  # fmt: skip
    return out


def _run(clients: list[WireClient], submits: list[protocol.Submit]) -> None:
    for i, msg in enumerate(submits):
        clients[i % len(clients)].send(msg)
    for k, c in enumerate(clients):
        c.wait([m.request_id for j, m in enumerate(submits) if j % len(clients) == k], timeout=120)


def test_200_streams_through_2_gateways_and_2_workers(service_model, redis_url, tmp_path):
    with stack(service_model, redis_url, tmp_path, workers=2, gateways=2) as s:
        clients = [WireClient(g.endpoint) for g in s.gateways]
        try:
            for c in clients:
                c.hello()
            streamed, plain = _submits(True), _submits(False)
            _run(clients, streamed)
            _run(clients, plain)
        finally:
            for c in clients:
                c.close()
        responses = {k: v for c in clients for k, v in c.responses.items()}
        errors = {k: v for c in clients for k, v in c.errors.items()}
        assert not errors, f"unexpected errors: {list(errors.items())[:3]}"

        for s_msg, n_msg in zip(streamed, plain, strict=True):
            chunks = responses[s_msg.request_id]
            finals = [i for i, r in enumerate(chunks) if r.is_final]
            assert finals == [len(chunks) - 1], f"{s_msg.request_id}: finals at {finals} of {len(chunks)}"
            assert all(r.result is not None for r in chunks)
            tokens = [t for r in chunks for t in r.result.output_token_ids[0]]  # type: ignore[union-attr]
            text = "".join(r.result.text[0] for r in chunks)  # type: ignore[union-attr,index]
            (whole,) = responses[n_msg.request_id]
            assert whole.is_final
            assert whole.result is not None
            assert whole.result.text is not None
            # Same seed, same tokens: nothing lost, duplicated or reordered on the way.
            assert tokens == whole.result.output_token_ids[0], s_msg.request_id
            assert text == whole.result.text[0], s_msg.request_id
            assert len(tokens) <= s_msg.max_tokens

        served_by = {s.request_stats(m.request_id)["worker"] for m in streamed}
        assert served_by == {"worker0", "worker1"}, "both workers take a share"
        for w in s.workers:
            s.wait_idle(w)
