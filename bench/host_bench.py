"""The engine core's host time per step, with the model taken out: the scheduler, the
block manager, the step's metadata and sampling arrays, and putting each sampled
token in place and answering for it, over the echo backend (worker/service/
echo_backend.py, which computes nothing), for decode batches of 64 to 1,024
sequences of the Llama-3.1-8B shape.

On a GPU this work overlaps the device's step (gpu_bench --profile reports how much
of it is exposed); it is also the floor of a step whatever the device: a 1,024-wide
decode step cannot be shorter than it. Figures are CPU time of this process
(`time.process_time`, robust to other load on the machine), best of five runs of
ten steps, after every request's prompt is in.

    python -m bench.host_bench
"""

from __future__ import annotations

import time

import numpy as np

TITLE = "engine core host time per decode step, echo backend (no model), 8B shape, 128-token prompts"
BATCHES = (64, 256, 1024)


def step_cpu_ms(batch: int) -> float:
    from bench.model_shapes import LLAMA_8B
    from worker.backends.echo_backend import EchoBackend
    from worker.executor import EngineCore, ExecutorConfig, KvCacheConfig, Request, SamplingConfig
    from worker.models.config import ModelConfig

    config = ExecutorConfig(max_batch_size=batch, max_num_tokens=8192,
                            kv_cache_config=KvCacheConfig(max_tokens=batch * 320))  # fmt: skip
    core = EngineCore(EchoBackend(ModelConfig.from_hf(LLAMA_8B)), config)
    rng = np.random.default_rng(0)
    sampling = SamplingConfig(temperature=0.0, min_tokens=128)
    core.add_requests(
        (i, Request(input_token_ids=rng.integers(100, 30000, 128).tolist(), max_tokens=128, streaming=True,
                    sampling_config=sampling))
        for i in range(batch)
    )  # fmt: skip
    while core.scheduler.waiting:
        core.step()
    for _ in range(3):
        core.step()
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(10):
            core.step()
        best = min(best, (time.process_time() - t0) / 10)
    assert len(core.scheduler.running) == batch, "every sequence decodes through the timed steps"
    return best * 1e3


def table() -> tuple[list[str], list[list[str]]]:
    header = ["decode batch", "host ms per step", "µs per sequence"]
    rows = []
    for batch in BATCHES:
        ms = step_cpu_ms(batch)
        rows.append([str(batch), f"{ms:.2f}", f"{ms * 1e3 / batch:.1f}"])
    return header, rows


def main() -> None:
    from bench.run import format_table

    header, rows = table()
    print(TITLE)
    print(format_table(header, rows))


if __name__ == "__main__":
    main()
