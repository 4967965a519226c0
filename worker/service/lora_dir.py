"""LoRA adapters a worker loads when a request names one: the adapter directories
under its --lora-dir, and the requests waiting for such a load.

Every subdirectory of the directory that holds an adapter_config.json is an adapter,
named by the subdirectory. The directory is read again whenever the worker announces
its adapters (so an adapter copied in shows up within a heartbeat), and a request's
adapter is looked up on disk when the request comes, never by joining a client's
string into a path that could leave the directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from worker.executor import types as ex

CONFIG_FILE = "adapter_config.json"

# A Submit taken but not yet enqueued, as WorkerService keeps them: (gateway, request id)
# and (the request, the client's id for it).
Taken = tuple[tuple[bytes, str], tuple[ex.Request, str]]


class LoraDir:
    def __init__(self, root: str | None) -> None:
        self.root = None if root is None else Path(root)

    def names(self) -> list[str]:
        """The adapters in the directory now, sorted (none when there is no directory or
        it cannot be read: the worker then serves what it holds)."""
        if self.root is None:
            return []
        try:
            return sorted(p.name for p in self.root.iterdir() if _usable(p.name) and (p / CONFIG_FILE).is_file())
        except OSError:
            return []

    def path(self, name: str) -> str | None:
        """The directory of adapter `name`, if the directory holds it now."""
        if self.root is None or not _usable(name):
            return None
        path = self.root / name
        return str(path) if (path / CONFIG_FILE).is_file() else None


def _usable(name: str) -> bool:
    """A name that is one plain entry of the directory (not hidden, no separator)."""
    return bool(name) and not name.startswith(".") and "/" not in name and "\\" not in name and len(name) <= 256


@dataclass(slots=True)
class PendingLoads:
    """Requests waiting for the adapter their worker loads on their demand: by adapter
    name, the load's token and the requests, in the order they came."""

    _loads: dict[str, tuple[int, list[Taken]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(len(waiting) for _, waiting in self._loads.values())

    def has(self, key: tuple[bytes, str]) -> bool:
        return any(k == key for _, waiting in self._loads.values() for k, _ in waiting)

    def join(self, name: str, taken: Taken) -> bool:
        """Wait for the load of `name` under way, if one is; False when none is."""
        load = self._loads.get(name)
        if load is not None:
            load[1].append(taken)
        return load is not None

    def start(self, token: int, name: str, taken: Taken) -> None:
        self._loads[name] = (token, [taken])

    def finish(self, token: int) -> list[Taken] | None:
        """The requests that waited for the load `token` (None: not a load on demand)."""
        name = next((n for n, (t, _) in self._loads.items() if t == token), None)
        return None if name is None else self._loads.pop(name)[1]

    def release(self, key: tuple[bytes, str]) -> Taken | None:
        """Stop one request waiting (it is cancelled): it is handed back."""
        for _, waiting in self._loads.values():
            for i, (k, _) in enumerate(waiting):
                if k == key:
                    return waiting.pop(i)
        return None

    def drop_gateway(self, gateway: bytes) -> None:
        """Forget the waiting requests of a gateway that is gone."""
        for _, waiting in self._loads.values():
            waiting[:] = [t for t in waiting if t[0][0] != gateway]
