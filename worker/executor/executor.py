"""The Executor: the TensorRT-LLM Executor API (enqueue, await, cancel, stats,
shutdown) as a thread and queues around one `EngineCore`.

The loop thread owns the core: it takes new requests and cancels, runs
`core.step()` and publishes what the step produced. Callers only touch the
queues guarded by `self._lock`. LoRA adapters are read from disk on the caller's
thread; the loop registers them between steps. The loop does the core's waiting
too: while nothing fits (`core.stalled`) it waits a moment for a cancel or a new
request rather than spinning.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from pathlib import Path
from typing import Any, overload

from worker.executor.engine_core import EngineCore
from worker.executor.types import ExecutorConfig, IterationStats, Request, RequestStats, Response

# How long a stalled loop waits before stepping again: a LoRA adapter read on the
# adapter cache's thread becomes ready without telling the loop.
STALLED_WAIT_S = 0.001


class Executor:
    def __init__(self, core: EngineCore) -> None:
        """Drive `core` from a thread of its own (`from_model` loads a model into one)."""
        self.core = core
        self.config = core.config
        self.tokenizer = core.tokenizer
        self.chat_template = core.chat_template
        self.model_config = core.model_config
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._incoming: list[tuple[int, Request]] = []
        self._cancels: list[int] = []
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []  # run by the loop between steps
        self._responses: list[Response] = []
        self._iteration_stats: deque[IterationStats] = deque(maxlen=self.config.iteration_stats_max)
        self._request_stats: deque[RequestStats] = deque(maxlen=self.config.iteration_stats_max)
        self._load = core.load()  # as of the loop's last turn
        self._shutdown = False
        self._thread = threading.Thread(target=self._loop, name="executor", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, path: str | Path, config: ExecutorConfig | None = None) -> Executor:
        """An executor over a checkpoint directory or .gguf file."""
        return cls(EngineCore.from_model(path, config))

    # -- public API --------------------------------------------------------------------

    def enqueue_request(self, request: Request, request_id: int | None = None) -> int:
        return self.enqueue_requests([request], None if request_id is None else [request_id])[0]

    def enqueue_requests(self, requests: Iterable[Request], request_ids: Seq[int] | None = None) -> list[int]:
        """Start requests; returns their ids: `request_ids` if given (the caller's,
        unique among its live requests), else ids the executor picks. An invalid
        request gets an error response, not an exception."""
        requests = list(requests)
        with self._lock:
            if self._shutdown:
                raise RuntimeError("executor is shut down")
            ids = [next(self._ids) for _ in requests] if request_ids is None else list(request_ids)
            if len(ids) != len(requests):
                raise ValueError(f"{len(ids)} request ids for {len(requests)} requests")
            self._incoming += zip(ids, requests, strict=True)
            self._lock.notify_all()
        return ids

    def can_enqueue_requests(self) -> bool:
        """Whether this process may enqueue: the executor is running (every process
        can while there is one rank; with several, only the leader)."""
        with self._lock:
            return not self._shutdown

    @overload
    def await_responses(self, id_or_ids: int | None = None, timeout: float | None = None) -> list[Response]: ...
    @overload
    def await_responses(self, id_or_ids: Seq[int], timeout: float | None = None) -> list[list[Response]]: ...

    def await_responses(
        self, id_or_ids: int | Seq[int] | None = None, timeout: float | None = None
    ) -> list[Response] | list[list[Response]]:
        """Responses ready for one id, for each of several ids, or for any id.
        Waits up to `timeout` seconds (None: until something is ready)."""
        wanted: set[int] | None
        if id_or_ids is None:
            wanted = None
        elif isinstance(id_or_ids, int):
            wanted = {id_or_ids}
        else:
            wanted = set(id_or_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                ready = self._responses if wanted is None else [r for r in self._responses if r.request_id in wanted]
                if ready or self._shutdown:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._lock.wait(remaining)
            if ready and wanted is None:
                self._responses = []  # all taken
            elif ready:
                taken = {id(r) for r in ready}
                self._responses = [r for r in self._responses if id(r) not in taken]
        if id_or_ids is None or isinstance(id_or_ids, int):
            return ready
        return [[r for r in ready if r.request_id == i] for i in id_or_ids]

    def cancel_request(self, request_id: int) -> None:
        with self._lock:
            self._cancels.append(request_id)
            self._lock.notify_all()

    def register_lora(self, name: str, path: str) -> None:
        """Read, check and register a PEFT adapter (CheckpointError names what is wrong)."""
        adapter = self.core.load_lora(path)
        self._on_loop(lambda: self.core.add_lora(name, path, adapter))

    def unregister_lora(self, name: str) -> None:
        self._on_loop(lambda: self.core.unregister_lora(name))

    def lora_names(self) -> list[str]:
        names: list[str] = self._on_loop(self.core.lora_names)
        return names

    def _on_loop(self, call: Callable[[], Any]) -> Any:
        """Run `call` on the loop thread between steps; its result or exception comes back."""
        done: Future[Any] = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("executor is shut down")
            self._calls.append((call, done))
            self._lock.notify_all()
        return done.result()

    def get_latest_iteration_stats(self) -> list[IterationStats]:
        with self._lock:
            stats = list(self._iteration_stats)
            self._iteration_stats.clear()
        return stats

    def get_latest_request_stats(self) -> list[RequestStats]:
        with self._lock:
            stats = list(self._request_stats)
            self._request_stats.clear()
        return stats

    def load(self) -> tuple[int, int, int]:
        """(queued, active, free KV blocks) as of the loop's last turn, cheap enough for every heartbeat."""
        with self._lock:
            queued, active, free = self._load
            return queued + len(self._incoming), active, free

    def shutdown(self) -> None:
        with self._lock:
            self._shutdown = True
            self._lock.notify_all()
        self._thread.join()
        close = getattr(self.core.backend, "close", None)  # a backend with rank processes stops them
        if close is not None:
            close()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        core = self.core
        while True:
            with self._lock:
                while not (self._shutdown or self._incoming or self._cancels or self._calls or core.has_work):
                    self._lock.wait()
                if core.stalled and not (self._shutdown or self._incoming or self._cancels or self._calls):
                    self._lock.wait(STALLED_WAIT_S)  # nothing fits yet: wait for cancels or new room
                if self._shutdown:
                    for _, done in self._calls:
                        done.set_exception(RuntimeError("executor is shut down"))
                    return
                incoming, self._incoming = self._incoming, []
                cancels, self._cancels = self._cancels, []
                calls, self._calls = self._calls, []
            for call, done in calls:
                try:
                    done.set_result(call())
                except Exception as e:  # the caller's to handle: the loop goes on
                    done.set_exception(e)
            core.add_requests(incoming)
            for request_id in cancels:
                core.abort(request_id)
            out = core.step()
            responses = out.all_responses()
            with self._lock:
                self._responses += responses
                self._iteration_stats.extend(out.iteration_stats)
                self._request_stats.extend(out.request_stats)
                self._load = core.load()
                if responses:
                    self._lock.notify_all()
