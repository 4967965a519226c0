"""The LoRA adapters an engine serves: registering them (from the driver,
between steps) and giving a waiting request's adapter a device slot when the
scheduler admits it (adapter_cache.py holds the adapters and the slots).

An adapter dropped from host memory is read again on the adapter cache's loader
thread, its requests waiting meanwhile, so an engine step never waits on a
file; one whose files no longer load fails its request alone, at the next step."""

from __future__ import annotations

from worker.backends.base import Backend, LoraBackend
from worker.executor.adapter_cache import AdapterCache
from worker.executor.scheduler import Scheduler
from worker.executor.sequence import Sequence
from worker.executor.types import ExecutorConfig, PeftCacheConfig
from worker.models.config import ModelConfig


class LoraRegistry:
    def __init__(self, backend: Backend, config: ExecutorConfig, model_config: ModelConfig) -> None:
        """LoRA slots take device memory: make this before the KV cache is sized, then `attach` the scheduler."""
        self.cache: AdapterCache | None = None
        self.scheduler: Scheduler | None = None
        self._errors: dict[int, str] = {}  # request id -> why its adapter could not be loaded
        if not config.lora_enabled:
            return
        if not isinstance(backend, LoraBackend):
            raise ValueError(f"the {backend.name} backend does not run LoRA adapters")
        peft = config.peft_cache_config or PeftCacheConfig()
        self.cache = AdapterCache(peft, model_config, backend)
        backend.enable_lora(peft.max_device_adapters, peft.max_rank)

    def attach(self, scheduler: Scheduler) -> LoraRegistry:
        """Admit a waiting sequence only once its adapter has a device slot (`ready`)."""
        self.scheduler = scheduler
        scheduler.adapter_ready = self.ready
        return self

    def on(self) -> AdapterCache:
        if self.cache is None:
            raise ValueError("LoRA is off on this executor: set ExecutorConfig.peft_cache_config to enable it")
        return self.cache

    def key(self, name: str) -> tuple[str, int]:
        """The registration a new request under adapter `name` runs with (ValueError: none)."""
        key = None if self.cache is None else self.cache.key(name)
        if key is None:
            raise ValueError(self.cache.unknown(name) if self.cache is not None
                             else f"unknown LoRA adapter {name!r} (held: none; LoRA is off on this worker)")
        return key

    def names(self) -> list[str]:
        return [] if self.cache is None else self.cache.names()

    def ready(self, seq: Sequence) -> bool:
        """Scheduler hook: put seq's adapter in a device slot if it can go there now."""
        assert self.cache is not None and self.scheduler is not None and seq.adapter is not None
        busy = {s.adapter for s in self.scheduler.running if s.adapter is not None}
        try:
            return self.cache.acquire(seq.adapter, busy) is not None
        except (ValueError, OSError) as e:  # unregistered, or its files no longer load: this request alone fails
            self._errors[seq.request_id] = str(e)
            return False

    def take_errors(self) -> dict[int, str]:
        """Requests whose adapter failed to load since the last call (request id -> why)."""
        errors, self._errors = self._errors, {}
        return errors
