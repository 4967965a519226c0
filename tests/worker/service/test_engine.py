"""The engine process: the executor behind pipes, held against the same executor in
process, and its life tied to the worker process's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import REPO, running
from worker.executor import Executor, ExecutorConfig, KvCacheConfig, Request, SamplingConfig
from worker.executor import types as ex
from worker.executor.engine_core import StepOutput
from worker.service.engine import EngineConfig, EngineFailed, EngineProcess


def _config(model: Path | str) -> EngineConfig:
    return EngineConfig(
        model=str(model),
        max_batch_size=8,
        max_num_tokens=512,
        max_beam_width=1,
        kv_tokens=4096,
        logits_post_processors=(),
        backend="numpy",
        device=None,
        log_level="WARNING",
        log_format="text",
    )


@pytest.fixture(scope="module")
def engine(long_model: Path) -> Iterator[EngineProcess]:
    e = EngineProcess(_config(long_model))
    yield e
    e.shutdown()


class Collected:
    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.finals: dict[int, ex.Response] = {}
        self.columns = 0  # streamed steps that crossed in columns
        self.request_stats: dict[int, ex.RequestStats] = {}


def _collect(engine: EngineProcess, ids: list[int], timeout: float = 60.0) -> Collected:
    got = Collected()
    deadline = time.monotonic() + timeout
    while len(got.finals) < len(ids):
        assert time.monotonic() < deadline, f"finals for {sorted(got.finals)} of {ids}"
        step = engine.await_step(timeout=1.0)
        if step is None:
            continue
        assert isinstance(step, StepOutput), step  # these tests load no LoRA adapter
        end = 0
        for i, n in zip(step.ids, step.counts, strict=True):
            start, end = end, end + n
            got.tokens.setdefault(i, []).extend(step.token_ids[start:end])
            got.columns += 1
        for r in step.responses:
            if r.result is not None:
                got.tokens.setdefault(r.request_id, []).extend(r.result.output_token_ids[0])
            if r.result is None or r.result.is_final:
                got.finals[r.request_id] = r
        got.request_stats.update((s.request_id, s) for s in step.request_stats)
    return got


def _greedy(prompt: list[int], max_tokens: int, streaming: bool) -> Request:
    return Request(
        input_token_ids=prompt,
        max_tokens=max_tokens,
        streaming=streaming,
        sampling_config=SamplingConfig(temperature=0.0),
    )


def test_streamed_tokens_equal_the_executor_in_process(engine: EngineProcess, long_model: Path) -> None:
    prompts = [[5, 6, 7], [11, 12], [40, 41, 42, 43], [7]]
    ids = engine.enqueue_requests([_greedy(p, 12, streaming=True) for p in prompts])
    got = _collect(engine, ids)
    assert got.columns > 0  # plain streamed steps crossed as columns
    config = ExecutorConfig(max_batch_size=8, kv_cache_config=KvCacheConfig(max_tokens=4096), backend="numpy")
    with Executor.from_model(long_model, config) as local:
        local_ids = local.enqueue_requests([_greedy(p, 12, streaming=False) for p in prompts])
        for i, local_id in zip(ids, local_ids, strict=True):
            (final,) = local.await_responses(local_id, timeout=60)
            assert final.result is not None
            assert got.tokens[i] == final.result.output_token_ids[0]
            result = got.finals[i].result
            assert result is not None and result.finish_reasons == [ex.FinishReason.LENGTH]


def test_ids_are_the_workers_and_stats_follow_them(engine: EngineProcess) -> None:
    first = engine.enqueue_requests([_greedy([5, 6], 3, streaming=True)])
    second = engine.enqueue_requests([_greedy([7, 8, 9], 2, streaming=True), _greedy([9], 2, streaming=True)])
    ids = first + second
    assert ids == list(range(ids[0], ids[0] + 3))  # assigned by the worker, at once
    got = _collect(engine, ids)
    assert {i: len(t) for i, t in got.tokens.items()} == {ids[0]: 3, ids[1]: 2, ids[2]: 2}
    assert {i: s.prompt_tokens for i, s in got.request_stats.items()} == {ids[0]: 2, ids[1]: 3, ids[2]: 1}
    deadline = time.monotonic() + 5
    iterations: list[ex.IterationStats] = []
    while not iterations or engine.load()[:2] != (0, 0):  # an idle engine still reports
        assert time.monotonic() < deadline, f"load {engine.load()}, {len(iterations)} iteration stats"
        engine.await_step(timeout=0.5)
        iterations += engine.get_latest_iteration_stats()
    assert engine.load()[2] > 0
    assert sum(s.num_scheduled_tokens for s in iterations) >= 2 + 3 + 1


def test_an_invalid_request_gets_an_error_for_itself_alone(engine: EngineProcess) -> None:
    bad, good = engine.enqueue_requests([_greedy([5, 10**6], 3, streaming=True), _greedy([5, 6], 3, streaming=True)])
    got = _collect(engine, [bad, good])
    error = got.finals[bad].error_msg
    assert error is not None and "1000000" in error
    assert len(got.tokens[good]) == 3


def test_cancel_ends_a_request_with_cancelled(engine: EngineProcess) -> None:
    (i,) = engine.enqueue_requests([Request(input_token_ids=[5, 6], max_tokens=3000, streaming=True,
                                            sampling_config=SamplingConfig(min_tokens=3000))])  # fmt: skip
    deadline = time.monotonic() + 30
    while not (isinstance(step := engine.await_step(timeout=1.0), StepOutput) and i in step.ids):  # streaming
        assert time.monotonic() < deadline, "no streamed step"
        assert not isinstance(step, StepOutput) or not step.responses, step.responses
    engine.cancel_request(i)
    got = _collect(engine, [i])
    final = got.finals[i].result
    assert final is not None and final.finish_reasons == [ex.FinishReason.CANCELLED]
    assert len(got.tokens[i]) < 3000


def test_a_model_that_cannot_load_names_why(tmp_path: Path) -> None:
    with pytest.raises(EngineFailed, match=r"could not load .*missing-model"):
        EngineProcess(_config(tmp_path / "missing-model"))


@pytest.mark.parametrize("stopped", [False, True], ids=["idle", "stopped loop"])
def test_the_engine_exits_when_the_worker_process_dies(long_model: Path, stopped: bool) -> None:
    """kill -9 of the worker leaves it no time to stop its engine, which must not
    live on holding the device: neither an idle engine (it reads the end of its pipe)
    nor one whose loop is stopped, which reads nothing (the kernel kills it)."""
    script = (
        "import sys, time\n"
        "from worker.service.engine import EngineConfig, EngineProcess\n"
        f"e = EngineProcess(EngineConfig({str(long_model)!r}, 8, 512, 1, 4096, (), 'numpy', None, 'WARNING', 'text'))\n"
        "print(e.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    worker = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    engine_pid = None
    try:
        assert worker.stdout is not None and worker.stderr is not None
        engine_pid = int(worker.stdout.readline())
        os.kill(engine_pid, 0)  # it runs
        if stopped:  # a stopped process reads nothing, not even the end of its pipe
            os.kill(engine_pid, signal.SIGSTOP)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        deadline = time.monotonic() + 10
        while running(engine_pid):
            assert time.monotonic() < deadline, "the engine outlived its worker"
            time.sleep(0.05)
    finally:
        worker.kill()
        worker.wait()
        if engine_pid is not None and running(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)


def test_the_engine_leaves_a_core_to_the_processes_beside_it(engine: EngineProcess) -> None:
    """Its math libraries run on all the cores it may use but one (threadpoolctl reads their limit back)."""
    assert engine.info.compute_threads == max(1, len(os.sched_getaffinity(0)) - 1)
