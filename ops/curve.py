"""CURVE authentication (ZeroMQ's own, through zmq.auth): key pairs on disk, the
ZAP handler that decides which peers a CURVE server accepts, the socket options
for either side, and the binding of a ROUTER routing identity to the key that
first used it (so a peer with another key cannot take the identity over).

Keys are zmq.auth certificate files: NAME.key (public) and NAME.key_secret
(both halves), made with `tokenwire keys generate DIR NAME`. A directory of
public .key files is an allow list (clients a gateway accepts, gateways a
worker accepts, workers a gateway connects to).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("tokenwire.curve")
_DOMAIN = "tokenwire"  # the ZAP domain of our CURVE servers


class CurveError(ValueError):
    """A key file or key directory that cannot be used; the text names it."""


@dataclass(frozen=True, slots=True)
class KeyPair:
    public: bytes  # z85, 40 bytes
    secret: bytes


def generate(directory: Path, name: str) -> tuple[Path, Path]:
    """Write NAME.key and NAME.key_secret into `directory`; the paths, public first."""
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / f"{name}.key_secret").exists():
        raise CurveError(f"{directory / name}.key_secret exists; remove it first to make a new key pair")
    public, secret = zmq.auth.create_certificates(directory, name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def load_keypair(secret_file: Path) -> KeyPair:
    try:
        public, secret = zmq.auth.load_certificate(secret_file)
    except (OSError, ValueError) as e:
        raise CurveError(f"{secret_file}: cannot read a CURVE key pair: {e}") from None
    if secret is None:
        raise CurveError(f"{secret_file}: holds no secret key (use the NAME.key_secret file)")
    return KeyPair(public, secret)


def load_public_key(path: Path) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise CurveError(f"{path}: cannot read a CURVE public key: {e}") from None
    return public


def load_public_keys(directory: Path) -> frozenset[bytes]:
    """Every public key in `directory`'s .key files."""
    if not directory.is_dir():
        raise CurveError(f"{directory}: not a directory of CURVE public keys")
    return frozenset(load_public_key(p) for p in sorted(directory.glob("*.key")))


@dataclass(frozen=True, slots=True)
class CurveConfig:
    """A service process's CURVE settings (None in its config: CURVE off)."""

    keypair: KeyPair
    allowed: frozenset[bytes] | None  # the peers it serves (gateways, or clients); None: any key
    workers: frozenset[bytes] = frozenset()  # a gateway's: the worker keys it connects to


@dataclass(frozen=True, slots=True)
class ClientCurve:
    """A client's CURVE settings: its key pair, and the public key its gateways serve with."""

    keypair: KeyPair
    server_public: bytes

    @classmethod
    def from_files(cls, secret_key_file: Path, server_key_file: Path) -> ClientCurve:
        return cls(load_keypair(secret_key_file), load_public_key(server_key_file))


class _Allowed:
    """zmq.auth credentials provider: accepts the listed keys (or any key) and logs each refusal."""

    def __init__(self, role: str, keys: frozenset[bytes] | None) -> None:
        self.role = role
        self.keys = keys  # None: any client that completes the CURVE handshake

    def callback(self, domain: str, key: bytes) -> bool:
        if self.keys is None or key in self.keys:
            return True
        log.warning("%s: refused a CURVE peer with an unknown public key %s", self.role, key.decode())
        return False


@dataclass(slots=True)
class CurveServer:
    """A process's CURVE server side: one ZAP handler thread for its context, and
    the options that make a socket a CURVE server checked by it."""

    role: str  # for the log lines: "worker", "gateway"
    keypair: KeyPair
    allowed: frozenset[bytes] | None  # None: any key
    _auth: ThreadAuthenticator | None = field(default=None, init=False)
    _watchers: list[threading.Thread] = field(default_factory=list, init=False)
    _stopping: threading.Event = field(default_factory=threading.Event, init=False)

    def start(self, ctx: zmq.Context) -> None:
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("tokenwire.curve.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(_DOMAIN, credentials_provider=_Allowed(self.role, self.allowed))

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._watchers:
            thread.join(timeout=1.0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def serve(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE server; call before bind."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keypair.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keypair.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, _DOMAIN.encode())
        self._watch(sock)

    def _watch(self, sock: zmq.Socket) -> None:
        """Log failed handshakes: a peer without CURVE, or with the wrong server key,
        never reaches the ZAP handler, so only the socket's monitor sees it."""
        monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
        thread = threading.Thread(target=self._log_failures, args=(monitor,), name="curve-monitor", daemon=True)
        self._watchers.append(thread)
        thread.start()

    def _log_failures(self, monitor: zmq.Socket) -> None:
        try:
            while not self._stopping.is_set():
                if not monitor.poll(200):
                    continue
                event = recv_monitor_message(monitor)
                reason = _REASONS.get(event["event"], "authentication failed")
                log.warning("%s: refused a peer at %s: %s (error %s)", self.role,
                            event["endpoint"].decode(errors="replace"), reason, event["value"])
        except zmq.ZMQError:
            pass  # the context is ending
        finally:
            monitor.close(0)


_NO_CURVE = "a peer without CURVE, or one expecting another server key"
_REASONS: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: f"no CURVE handshake ({_NO_CURVE})",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: f"a bad CURVE handshake ({_NO_CURVE})",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "its key was refused",
}
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def connect_as_client(sock: zmq.Socket, keypair: KeyPair, server_public: bytes) -> None:
    """Make `sock` a CURVE client of the server with `server_public`; call before connect."""
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keypair.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keypair.secret)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)


# A gateway's routing identity toward a worker is its name, this separator and a secret made
# per socket, with or without CURVE. The name is public (Redis shows it); the secret is not, so
# a taker connects under another identity and its messages reach IdentityKeys. (libzmq silently
# ignores a second connection under an identity in use.)
_SECRET_SEPARATOR = b"\0"


def routing_id(name: str) -> bytes:
    """A routing identity for a gateway's socket: `name` and a secret suffix."""
    return name.encode() + _SECRET_SEPARATOR + secrets.token_hex(8).encode()


def identity_name(identity: bytes) -> bytes:
    """The name part of a routing identity (all of it, if it has no secret suffix):
    what logs and stats show, never the secret. The ids libzmq makes up for peers
    that set none start with the separator: each is a name of its own."""
    return identity.partition(_SECRET_SEPARATOR)[0] or identity


class IdentityKeys:
    """The credential that first spoke under each routing identity's name: under
    CURVE the peer's key, without it the whole routing identity (its secret suffix
    is known to its owner only). A message under a known name with another
    credential is an identity takeover: refused, and logged. Frames must be
    received with copy=False so that their User-Id (the peer's z85 key, set by the
    ZAP handler) can be read."""

    def __init__(self, role: str, curve: bool) -> None:
        self.role = role
        self.curve = curve
        self._keys: dict[bytes, str] = {}

    def _credential(self, identity: bytes, frame: zmq.Frame) -> str:
        if self.curve:
            return f"key {frame.get('User-Id')}"
        # Logged, so a digest: the identity itself would give its secret away.
        return f"connection {hashlib.sha256(identity).hexdigest()[:12]}"

    def admit(self, identity: bytes, frame: zmq.Frame) -> bool:
        key = self._credential(identity, frame)
        name = identity_name(identity)
        first = self._keys.setdefault(name, key)
        if first == key:
            return True
        log.warning(
            "%s: refused an identity takeover: %r is bound to %s, a peer with %s at %s used it",
            self.role, name.decode(errors="replace"), first, key, frame.get("Peer-Address"),
        )  # fmt: skip
        return False

    def forget(self, name: bytes) -> None:
        """The named peer is gone for good: none of its sockets is heard from any more."""
        self._keys.pop(name, None)
