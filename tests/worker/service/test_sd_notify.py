"""A real worker process under a NOTIFY_SOCKET of the test's own: the notify messages
and their order (no READY before the model is loaded and the socket bound, then
WATCHDOG pings from the executor loop, STOPPING on SIGTERM), and a worker whose
engine process stops (SIGSTOP: its loop no longer turns) stops pinging."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import zmq

import protocol
from ops.process import spawned
from tests.notify import NotifySocket, notify_socket
from tests.procs import Worker
from worker.service.engine import LOOP_STUCK_AFTER_S


@pytest.fixture
def notify(monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    with notify_socket(monkeypatch) as ns:
        yield ns


def _answers_hello(worker: Worker) -> bool:
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(worker.endpoint)
    try:
        sock.send(protocol.encode(protocol.Hello(sender_id="probe", role="gateway", heartbeat_interval_s=1.0)))
        return bool(sock.poll(5000)) and isinstance(protocol.decode(sock.recv()), protocol.Ready)
    finally:
        sock.close()


def test_ready_then_watchdog_then_stopping(notify, service_model, redis_url, tmp_path):
    worker = Worker("notified", service_model, redis_url, tmp_path)
    try:
        ready = notify.wait_for("READY", timeout=60)
        # READY comes after the model is loaded and the socket bound: the log already
        # says the engine core is up, and the socket answers at once.
        assert "engine core: backend=" in worker.log()
        assert ready["MAINPID"] == str(worker.process.pid)
        assert "serving" in ready["STATUS"] and "KV blocks" in ready["STATUS"]
        assert _answers_hello(worker)
        for _ in range(3):
            notify.wait_for("WATCHDOG", timeout=5)
        # STATUS stays current: the load, every heartbeat interval.
        assert "0 active, 0 queued" in notify.wait_for("STATUS", timeout=5)["STATUS"]
        worker.process.send_signal(signal.SIGTERM)
        stopping = notify.wait_for("STOPPING", timeout=10)
        assert stopping["STATUS"].startswith("draining")
        assert worker.process.wait(timeout=30) == 0
    finally:
        worker.stop()
    kinds = notify.kinds()
    assert kinds[0] == "STATUS"  # "loading ...", before anything else
    assert kinds.count("READY") == 1 and kinds.count("STOPPING") == 1
    ready_at, stopping_at = kinds.index("READY"), kinds.index("STOPPING")
    assert set(kinds[:ready_at]) == {"STATUS"}  # no watchdog ping before READY
    assert kinds[ready_at + 1 : stopping_at].count("WATCHDOG") >= 3


def test_a_hung_executor_loop_stops_the_watchdog(notify, service_model, redis_url, tmp_path):
    worker = Worker("hangs", service_model, redis_url, tmp_path)
    try:
        notify.wait_for("READY", timeout=60)
        notify.wait_for("WATCHDOG", timeout=5)
        [engine] = spawned(worker.process.pid)
        os.kill(engine, signal.SIGSTOP)  # the engine's loop stops turning; the worker's threads run on
        hung_at = last_ping = time.monotonic()
        while time.monotonic() - last_ping < 0.5:  # pings sent before the hang, still queued
            fields = notify.receive(timeout=0.1)
            if fields is not None and "WATCHDOG" in fields:
                last_ping = time.monotonic()
            # The loop counts as stuck LOOP_STUCK_AFTER_S after its last turn; a ping sent
            # just before that, and its delivery, come on top.
            assert time.monotonic() - hung_at < LOOP_STUCK_AFTER_S + 1.0, "WATCHDOG=1 goes on from a hung loop"
        silent_from = time.monotonic()
        statuses = 0
        while time.monotonic() - silent_from < 1.5:  # 15 ping intervals
            fields = notify.receive(timeout=0.2)
            assert fields is None or "WATCHDOG" not in fields, "WATCHDOG=1 from a hung loop"
            statuses += fields is not None and "STATUS" in fields
        # The process lives on, and its I/O thread still reports STATUS: only the
        # watchdog can tell that the executor is stuck.
        assert worker.alive
        assert statuses > 0
    finally:
        worker.kill9()
        worker.stop()
