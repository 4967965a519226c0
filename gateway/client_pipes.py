"""What the gateway sends its ZeroMQ clients, and what happens to one that stops reading.

A ROUTER queues each peer's messages without limit unless told otherwise, so a client
that submits and never reads would grow the gateway's memory by every token it is sent.
Here each client's queue holds at most `limit` messages (one message carries every token
an engine step made for that client's requests), and ROUTER_MANDATORY turns a full queue
into an error instead of a silent drop. That client is cut off: the gateway cancels its
requests and owes it one error per request, naming why, sent once it reads again. Each
client's queue is its own, so one that stops reading never delays another's stream.

The HTTP front's bridge is the exception: it carries every HTTP client, reads on its own
event loop, and bounds each HTTP stream itself; a send to it waits instead.
"""

from __future__ import annotations

import time

import zmq

# How long an owed error waits for its client to read again before it is dropped.
OWED_TTL_S = 300.0


class ClientPipes:
    """Sends on the gateway's client-facing ROUTER; used from the gateway's loop only."""

    def __init__(self, frontend: zmq.Socket[bytes], limit: int, patient: bytes) -> None:
        frontend.setsockopt(zmq.SNDHWM, limit)
        frontend.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.limit = limit
        self._frontend = frontend
        self._patient = patient  # the bridge's routing id: sends to it wait
        self._owed: dict[bytes, tuple[float, list[bytes]]] = {}  # cut-off client -> (since, messages)

    def send(self, client: bytes, payload: bytes) -> bool:
        """Queue `payload` for `client`. False: its queue is full, or it is cut off and
        must be told why first. A client no longer connected is not sent anything, as a
        ROUTER does by default (its heartbeats' silence ends it)."""
        if client in self._owed:
            return False
        try:
            self._frontend.send_multipart([client, payload], 0 if client == self._patient else zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
        return True

    def owe(self, client: bytes, messages: list[bytes]) -> None:
        """Messages for a cut-off client, sent (in order) once it reads again."""
        since, owed = self._owed.get(client, (time.monotonic(), []))
        self._owed[client] = (since, owed + messages)

    def pay(self) -> None:
        """Send what the cut-off clients are owed, as far as each one's queue allows; forget
        a client once it has all of it, or once it has read nothing for OWED_TTL_S."""
        now = time.monotonic()
        for client, (since, owed) in list(self._owed.items()):
            while owed:
                try:
                    self._frontend.send_multipart([client, owed[0]], zmq.NOBLOCK)
                except (zmq.Again, zmq.ZMQError):
                    break
                owed.pop(0)
            if not owed or now - since > OWED_TTL_S:
                del self._owed[client]

    def owing(self, client: bytes) -> bool:
        return client in self._owed
