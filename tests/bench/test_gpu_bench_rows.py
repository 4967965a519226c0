"""gpu_bench's rows: each runs the requests that fill the decode batch its limits allow and
states that batch, its bound, its KV tokens and TensorRT-LLM's figure where one exists
(the tiny model end to end on the CPU, and the table of a row on an H200)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_bench import format_rows
from bench.model_shapes import LLAMA_8B
from bench.offline_runs import Row
from bench.roofline import roofline_of
from bench.row_limits import FILL
from worker.models.config import ModelConfig

REPO = Path(__file__).resolve().parents[2]


def test_tiny_rows_fill_their_batch_and_name_its_bound(tmp_path: Path) -> None:
    # At 12 sequences and 96 tokens a step: 16/64 fills the batch cap; 64/8 is bound by the token
    # budget (a step of 96 tokens sustains 9 decoding sequences while it prefills the next
    # prompts); 16/16's waves run in step, each refilling the batch over two steps after the last drained.
    command = [sys.executable, "-m", "bench.gpu_bench", "--tiny", "--device", "cpu", "--dtype", "float32",
               "--skip-hf", "--max-batch", "12", "--max-num-tokens", "96", "--max-model-len", "128"]  # fmt: skip
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OUT": str(tmp_path)})  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["workload"]: r for r in json.loads((tmp_path / "gpu_bench.json").read_text())["rows"]}
    assert {w: (r["batch_cap"], r["batch_bound"]) for w, r in rows.items()} == {
        "16/16": (12, "wave refill"), "16/64": (12, "--max-batch"), "64/8": (9, "token budget")}  # fmt: skip
    for row in rows.values():
        assert row["requests"] % row["batch_cap"] == 0
        # the engine decodes the batches its scheduler's model said it would
        assert row["mean_batch"] == pytest.approx(row["extra"]["expected_batch"], abs=0.1)
        assert row["extra"]["kv_tokens"] > 0
        assert math.isnan(row["published_tok_s"])  # no published figure for the tiny shape on the CPU
    assert rows["16/64"]["extra"]["expected_batch"] >= FILL * 12 and rows["64/8"]["extra"]["expected_batch"] >= FILL * 9
    assert rows["16/16"]["extra"]["expected_batch"] < FILL * 12
    assert rows["64/8"]["requests"] > 9  # ramp and drain take several waves to amortize
    assert "mean batch (cap: bound)" in run.stdout and " (9: token budget) " in run.stdout


def test_a_published_row_shows_its_share_of_the_published_figure() -> None:
    roof = roofline_of(ModelConfig.from_hf(LLAMA_8B), "fp8", 2, 4.1e12, 1.4e15, kv_cache_dtype="fp8")
    row = Row("1000/1000", 842, 50.0, 842_000, mean_batch=800.4, batch_cap=842, batch_bound="KV cache",
              published_tok_s=17_744, roofline_tok_s=27_000, extra={"kv_tokens": 1_750_000})  # fmt: skip
    header, [cells] = format_rows([row], roof)
    table = dict(zip(header, cells, strict=True))
    assert table["TensorRT-LLM published (share)"] == "17,744 (0.95)"  # 16,840 tok/s
    assert table["mean batch (cap: bound)"] == "800 (842: KV cache)"
    assert table["KV tokens"] == "1,750,000"
    assert table["decode bound"] == "HBM"  # 842 sequences of ~1,500 tokens read 83 GB of FP8 KV a step
