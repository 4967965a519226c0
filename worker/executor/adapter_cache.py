"""Which LoRA adapters are registered, held in host memory, and resident on the device.

Registered adapters are known by name and PEFT directory; each registration gets a key
(name, generation) so that requests, device slots and prefix-cache hashes bound to one
registration never mix with a later one under the same name.

Host memory holds up to `max_host_adapters` loaded adapters, least recently used
dropped first; a dropped one is read again from disk when a request needs it, on a
loader thread of its own, so the engine step never waits on a file: the request stays
queued until it is loaded. The device holds `max_device_adapters` slots; an adapter is
written into a free slot when a request is admitted, else into the least recently used
slot that no running request uses. When every slot is busy the request waits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set
from concurrent.futures import Future, ThreadPoolExecutor

from worker.backends.base import LoraBackend
from worker.executor.types import PeftCacheConfig
from worker.models.config import ModelConfig
from worker.models.lora import LoraAdapter, load_lora_adapter

AdapterKey = tuple[str, int]  # (name, registration number)


class AdapterCache:
    def __init__(self, config: PeftCacheConfig, model: ModelConfig, backend: LoraBackend) -> None:
        if config.max_device_adapters < 1 or config.max_host_adapters < 1 or config.max_rank < 1:
            raise ValueError(f"PeftCacheConfig needs max_device_adapters, max_host_adapters and max_rank >= 1, "
                             f"got {config}")
        self.config, self.model, self.backend = config, model, backend
        self._registered: dict[str, tuple[AdapterKey, str]] = {}  # name -> (key, directory)
        self._generation = 0
        self._host: OrderedDict[AdapterKey, LoraAdapter] = OrderedDict()  # least recently used first
        self._slots: OrderedDict[AdapterKey, int] = OrderedDict()  # resident adapters, least recently used first
        self._free_slots = list(range(config.max_device_adapters))
        self._loading: dict[AdapterKey, Future[LoraAdapter]] = {}
        self._loader: ThreadPoolExecutor | None = None

    # -- registration (outside the engine step) ----------------------------------------------

    def load(self, path: str) -> LoraAdapter:
        """Read and check an adapter against the model (CheckpointError names the problem)."""
        return load_lora_adapter(path, self.model, self.config.max_rank)

    def add(self, name: str, path: str, adapter: LoraAdapter) -> None:
        """Register a loaded adapter; a name registered before now means this one."""
        self._generation += 1
        key = (name, self._generation)
        self._registered[name] = (key, path)
        self._keep_on_host(key, adapter)

    def remove(self, name: str) -> AdapterKey:
        """Unregister: new requests can no longer name it; running ones keep its slot
        until they end (then it is the first to be reused). Returns the key it had."""
        if name not in self._registered:
            raise ValueError(self.unknown(name))
        key, _ = self._registered.pop(name)
        self._host.pop(key, None)
        if key in self._slots:
            self._slots.move_to_end(key, last=False)
        return key

    def names(self) -> list[str]:
        return sorted(self._registered)

    def key(self, name: str) -> AdapterKey | None:
        found = self._registered.get(name)
        return None if found is None else found[0]

    def unknown(self, name: str) -> str:
        return f"unknown LoRA adapter {name!r} (held: {', '.join(self.names()) or 'none'})"

    # -- the engine step ----------------------------------------------------------------------

    def acquire(self, key: AdapterKey, busy: Set[AdapterKey]) -> int | None:
        """The device slot of `key`, writing it into one if needed; None while it loads
        from disk or while every slot is used by the adapters in `busy`. Raises
        ValueError if it is no longer registered, CheckpointError if it no longer loads."""
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
            return slot
        adapter = self._host_copy(key)
        if adapter is None:
            return None
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((k for k in self._slots if k not in busy), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
        self.backend.load_lora_slot(slot, adapter)
        self._slots[key] = slot
        return slot

    def slot(self, key: AdapterKey) -> int:
        """The slot of a resident adapter (one a running request uses)."""
        return self._slots[key]

    def _host_copy(self, key: AdapterKey) -> LoraAdapter | None:
        adapter = self._host.get(key)
        if adapter is not None:
            self._host.move_to_end(key)
            return adapter
        name = key[0]
        if self._registered.get(name, (None,))[0] != key:
            raise ValueError(self.unknown(name))
        pending = self._loading.get(key)
        if pending is None:
            if self._loader is None:
                self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-loader")
            self._loading[key] = self._loader.submit(self.load, self._registered[name][1])
            return None
        if not pending.done():
            return None
        del self._loading[key]
        adapter = pending.result()  # a CheckpointError (files changed since) goes to the caller
        self._keep_on_host(key, adapter)
        return adapter

    def _keep_on_host(self, key: AdapterKey, adapter: LoraAdapter) -> None:
        self._host[key] = adapter
        while len(self._host) > self.config.max_host_adapters:
            self._host.popitem(last=False)
