"""Secure binds: a socket reachable beyond this host needs a credential in front
of it (CURVE for ZeroMQ, API keys for HTTP), or an explicit --insecure. /metrics
takes no credential: beyond this host it needs --insecure.

Without one, anyone who can reach the port can run requests (and, at a worker,
act as a gateway). So a service refuses to start on such a bind, in one line that
says what to set; --insecure starts it anyway, with a warning at start and in
the gateway's /health.
"""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def add_insecure_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--insecure", action="store_true",
                   help="serve on an address beyond this host without CURVE or API keys (anyone who can "
                   "reach it may use it); warned at start and in /health")  # fmt: skip


def is_local_host(host: str) -> bool:
    """Whether `host` (a name or an address) is reachable from this host only."""
    host = host.strip("[]")
    if host in _LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another name, an interface, or * (every interface)


def is_local_endpoint(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint is reachable from this host only: ipc, inproc, or
    tcp on a loopback address."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False  # pgm, epgm, udp...: multicast or network transports
    return is_local_host(urlsplit(f"//{rest}").hostname or rest.rsplit(":", 1)[0])


@dataclass(frozen=True, slots=True)
class Bind:
    """One listening address and whether a credential guards it."""

    option: str  # the flag that sets it, e.g. --bind
    address: str
    local: bool
    guarded: bool
    remedy: str  # what to set so that it is guarded


def metrics_bind(host: str) -> Bind:
    """The /metrics listener's bind. It takes no credential, and its counts name API keys
    and models, so beyond this host it is served only under --insecure (or behind a
    proxy that checks credentials, reaching it on loopback)."""
    return Bind("--metrics-host", host, is_local_host(host), False,
                "a scrape proxy with credentials in front of --metrics-host 127.0.0.1")  # fmt: skip


def check_binds(role: str, binds: list[Bind], insecure: bool) -> list[str]:
    """The warnings to give (under --insecure) for each unguarded public bind;
    SystemExit with one line where there is one and --insecure was not given."""
    open_binds = [b for b in binds if not b.local and not b.guarded]
    if open_binds and not insecure:
        b = open_binds[0]
        raise SystemExit(
            f"tokenwire {role}: {b.option} {b.address} is reachable beyond this host with no credential: "
            f"set {b.remedy}, bind to 127.0.0.1, or pass --insecure to serve it open"
        )
    return [f"{b.option} {b.address} is reachable beyond this host with no credential ({b.remedy} is not set)"
            for b in open_binds]  # fmt: skip
