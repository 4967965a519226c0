"""A gateway sends a worker that takes them the submits of one turn of its loop as one
SubmitBatch (protocol/submit_batch.py), seen from a bare worker peer on the wire."""

from __future__ import annotations

import time

import protocol
from tests.gateway.test_wire_ids import WorkerPeer
from tests.integration.wire import WireClient
from tests.procs import Gateway


def test_a_burst_reaches_the_worker_in_batches_in_order_with_its_cancel_after(redis_url, tmp_path):
    peer = WorkerPeer(redis_url, submit_batches=True)
    gateway = Gateway("gw-batches", redis_url, tmp_path)
    client = WireClient(gateway.endpoint)
    try:
        deadline = time.monotonic() + 30
        while peer.gateway is None:
            assert time.monotonic() < deadline, gateway.log()
            peer.pump(0.1)
        client.hello()
        ids = [f"r{i}" for i in range(40)]
        encoded = [protocol.encode(protocol.Submit(request_id=r, input_token_ids=[1, i + 2], max_tokens=4))
                   for i, r in enumerate(ids)]  # fmt: skip
        for data in encoded:  # back to back: the gateway reads several in one turn of its loop
            client.sock.send(data)
        client.send(protocol.Cancel(request_id="r7"))
        got = peer.wait_for(protocol.Submit, len(ids))
        cancel = peer.wait_for(protocol.Cancel, 1)[0]
        assert [m.request_id for m in got if isinstance(m, protocol.Submit)] == ids
        assert [m.input_token_ids for m in got if isinstance(m, protocol.Submit)] == [[1, i + 2] for i in range(40)]
        assert max(peer.batches) > 1, f"no batch carried more than one submit: {peer.batches}"
        assert isinstance(cancel, protocol.Cancel) and cancel.request_id == "r7"
        assert peer.received.index(cancel) > [getattr(m, "request_id", None) for m in peer.received].index("r7")
    finally:
        client.close()
        gateway.stop()
        peer.close()
