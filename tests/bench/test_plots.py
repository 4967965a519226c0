"""The plot command on small saved results: gpu_bench's and quant_bench's JSON for the roofline
shares, serving_bench's for the serving curves; images drawn, shares read the right way."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from matplotlib import image

from bench.plots import main, roofline_shares
from bench.saved_runs import saved_roofline, saved_roofline_tok_s

H100 = {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-21 20:40 UTC"}
GPU_RUN = {  # as gpu_bench saves it; its roofline_tok_s an older model's, to be recomputed
    "environment": H100, "bandwidth_TBps": 3.0, "gemm_TFLOPps": 700.0, "model_shape": "8b",
    "rows": [{"workload": "1000/1000", "requests": 64, "tok_s": 4000.0, "roofline_tok_s": 1.0,
              "extra": {"kv_tokens": 200_000, "max_batch": 64}},
             {"workload": "128/128", "requests": 256, "tok_s": 9000.0, "roofline_tok_s": 1.0,
              "extra": {"kv_tokens": 200_000, "max_batch": 256}}],
}  # fmt: skip
QUANT_RUN = {  # as quant_bench saves it: a batch-1 row beside the offline one
    "environment": {**H100, "date": "2026-11-23 06:21 UTC"}, "quantization": "fp8",
    "rows": [{"workload": "128/128", "requests": 1024, "tok_s": 22293, "roofline_tok_s": 42288, "kv_cache": "fp8"},
             {"workload": "batch 1, 128/128", "ttft_ms": 12.0, "tpot_ms": 3.1, "tpot_floor_ms": 2.3}],
}  # fmt: skip


def serving_run(path: str, rate: float, ttft: float) -> dict[str, object]:
    return {"model": "tiny", "path": path, "rate": rate, "seconds": 2.0, "tokens": 512, "requests": 8,
            "ttft_ms": [ttft, 2 * ttft], "itl_ms": [1.0, 1.5, 2.0], "e2e_ms": [50.0, 60.0]}  # fmt: skip


def test_shares_use_todays_roofline_for_gpu_bench_runs_and_the_recorded_one_otherwise() -> None:
    shares = dict(roofline_shares([GPU_RUN, QUANT_RUN]))
    roof = saved_roofline(GPU_RUN)
    long = saved_roofline_tok_s(roof, GPU_RUN, "1000/1000", 64, {"kv_tokens": 200_000, "max_batch": 64})
    assert shares["1000/1000  H100 8b bf16, 2026-11-21 20:40"] == pytest.approx(4000.0 / long)
    assert shares["128/128  H100 8b fp8, 2026-11-23 06:21 +fp8 KV"] == pytest.approx(22293 / 42288)
    # the batch-1 row has no throughput to share; the workloads go shortest first
    assert [label.split()[0] for label in shares] == ["128/128", "128/128", "1000/1000"]


def test_the_command_draws_both_images_from_the_saved_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    results, out = tmp_path / "results", tmp_path / "img"
    results.mkdir()
    (results / "a.json").write_text(json.dumps(GPU_RUN))
    (results / "b.json").write_text(json.dumps(QUANT_RUN))
    (results / "lora.json").write_text(json.dumps({"adapters": 16, "kernel": []}))  # not a throughput run
    runs = [serving_run(path, rate, 10.0 * (i + 1)) for path in ("in process", "gateway + worker")
            for i, rate in enumerate([math.inf, 1.0, 2.0])]  # fmt: skip
    with gzip.open(results / "serving_bench_tiny_cpu_2026-11-27.json.gz", "wt") as f:
        json.dump({"args": {"requests": 8}, "runs": runs}, f)
    with gzip.open(results / "serving_bench_tiny_cpu_2026-11-20.json.gz", "wt") as f:  # older: not the one drawn
        json.dump({"args": {"requests": 8}, "runs": []}, f)

    main(["--results", str(results), "--out", str(out)])

    for name in ("roofline_shares.png", "serving_curves.png"):
        pixels = image.imread(out / name)
        assert pixels.shape[0] > 200 and pixels.shape[1] > 200
        assert pixels[..., :3].std() > 0.05  # something drawn, not a blank canvas
    assert "serving_curves.png" in capsys.readouterr().out


def test_without_serving_json_the_command_says_what_it_needs(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    (tmp_path / "a.json").write_text(json.dumps(GPU_RUN))
    main(["--results", str(tmp_path), "--out", str(tmp_path / "img")])
    assert not (tmp_path / "img" / "serving_curves.png").exists()
    assert "serving_bench_*.json.gz" in capsys.readouterr().out


def test_no_throughput_runs_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no run with offline rows"):
        main(["--results", str(tmp_path), "--out", str(tmp_path / "img")])
