"""Plots of saved bench results, for the docs (matplotlib: the `bench` extra).

- roofline_shares.png: each offline workload's output tok/s as a share of its roofline, a
  bar per saved run and workload: from the JSON gpu_bench writes (every JSON under
  --results whose rows carry `tok_s` and `roofline_tok_s`, whatever its file name).
- serving_curves.png: output tok/s against TTFT and ITL (p50 solid, p99 dashed) at each
  request rate, a line per model and path (in process; gateway + worker): from the
  gzipped JSON serving_bench writes to $OUT/serving_bench.json.gz; by default the newest
  bench/results/serving_bench_*.json.gz (the names start with what ran and end with the
  date), or the file given with --serving.

    python -m bench.plots                    # both images from bench/results/
    OUT=/tmp/serving python -m bench.serving_bench --model tiny --requests 24
    python -m bench.plots --serving /tmp/serving/serving_bench.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server

import matplotlib.pyplot as plt

from bench.saved_runs import saved_roofline, saved_roofline_tok_s
from bench.stream_timing import pct

REPO = Path(__file__).resolve().parents[1]


def run_label(saved: dict[str, Any]) -> str:
    """'H100 8b fp8 +fp8 KV, 2026-11-23 06:32' from what the run recorded about itself."""
    env = saved.get("environment", {})
    gpus = saved.get("tensor_parallel_size", 1) * saved.get("pipeline_parallel_size", 1)
    gpu = env.get("gpu", "cpu").removeprefix("NVIDIA ").split()[0] + (f" x{gpus}" if gpus > 1 else "")
    split = f" pp{pp}" if (pp := saved.get("pipeline_parallel_size", 1)) > 1 else ""
    weights = saved.get("quantization") or {"bfloat16": "bf16", "float32": "fp32"}.get(saved.get("dtype", ""), "bf16")
    kv = " +fp8 KV" if saved.get("kv_cache_dtype") == "fp8" else ""
    return f"{gpu} {saved.get('model_shape', '8b')}{split} {weights}{kv}, {env.get('date', '?')[:16]}"


def roofline_shares(saved_runs: Sequence[dict[str, Any]]) -> list[tuple[str, float]]:
    """(run and workload, tok/s over roofline tok/s) of every offline row of the runs, the
    workloads in order of length. gpu_bench's own runs get today's roofline of their measured
    ceilings (bench/saved_runs.py: older runs recorded an older model's); the quantized runs'
    JSON (quant_bench) records too little for that and keeps the roofline it computed."""
    shares = []
    for saved in saved_runs:
        label = run_label(saved)
        roof = saved_roofline(saved) if "gemm_TFLOPps" in saved else None
        for row in saved.get("rows", []):
            if not (row.get("tok_s") and row.get("roofline_tok_s")):
                continue  # a batch-1 row
            roofline = row["roofline_tok_s"] if roof is None else saved_roofline_tok_s(
                roof, saved, row["workload"], row["requests"], row.get("extra", {}))  # fmt: skip
            kv = " +fp8 KV" if row.get("kv_cache") == "fp8" and "fp8 KV" not in label else ""
            prompt, output = (int(x) for x in row["workload"].split("/"))
            shares.append(((prompt, output, label + kv), row["tok_s"] / roofline))
    return [(f"{p}/{o}  {label}", share) for (p, o, label), share in sorted(shares)]


def plot_roofline_shares(saved_runs: Sequence[dict[str, Any]], out: Path) -> None:
    shares = roofline_shares(saved_runs)
    if not shares:
        raise ValueError("no run with offline rows (tok_s and roofline_tok_s) to plot")
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(shares) + 1.2))
    at = range(len(shares))  # positions, not the labels: a categorical axis would merge equal labels
    ax.barh(at, [s[1] for s in shares], color="tab:blue")
    ax.set_yticks(at, [s[0] for s in shares], fontsize=8)
    for i, (_, share) in enumerate(shares):
        ax.text(share + 0.01, i, f"{share:.0%}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.1)
    ax.xaxis.set_major_formatter(lambda x, _: f"{x:.0%}")
    ax.set_xlabel("output tok/s as a share of the roofline (offline, all requests at once)")
    ax.set_title("gpu_bench: share of the roofline")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_serving_curves(saved: dict[str, Any], out: Path) -> None:
    """One line per (model, path); its points are the rates, burst last."""
    series: dict[str, list[dict[str, Any]]] = {}
    for run in saved["runs"]:
        series.setdefault(f"{run['model']}, {run['path']}", []).append(run)
    if not series:
        raise ValueError("the serving JSON has no runs")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for (name, runs), color in zip(series.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False):
        runs = sorted(runs, key=lambda r: float(r["rate"]))  # "inf" (the burst) last
        tok_s = [r["tokens"] / r["seconds"] for r in runs]
        for ax, key in zip(axes, ("ttft_ms", "itl_ms"), strict=True):
            for q, style in ((50, "-"), (99, "--")):
                ax.plot(tok_s, [pct(r[key], q) for r in runs], style, marker="o", color=color,
                        label=f"{name} p{q}")  # fmt: skip
            for x, r in zip(tok_s, runs, strict=True):
                rate = float(r["rate"])
                ax.annotate("burst" if math.isinf(rate) else f"{rate:.1f}/s", (x, pct(r[key], 50)), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))  # fmt: skip
    for ax, what in zip(axes, ("TTFT", "ITL"), strict=True):
        ax.set_xlabel("output tok/s")
        ax.set_ylabel(f"{what} ms")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    args = saved.get("args", {})
    fig.suptitle(f"serving_bench: Poisson arrivals per request rate, {args.get('requests', '?')} requests x "
                 f"{args.get('prompt', '?')} / {args.get('output', '?')} tokens")  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def saved_gpu_runs(results: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(results.glob("*.json")):
        saved = json.loads(path.read_text())
        if isinstance(saved, dict) and any("roofline_tok_s" in r for r in saved.get("rows", [])):
            runs.append(saved)
    return runs


def newest_serving_run(results: Path) -> Path | None:
    """The serving_bench run saved last: its file name ends with its date."""
    saved = sorted(results.glob("serving_bench_*.json.gz"), key=lambda p: p.name.removesuffix(".json.gz")[-10:])
    return saved[-1] if saved else None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=REPO / "bench" / "results", help="gpu_bench JSON files here")
    p.add_argument("--serving", type=Path, default=None,
                   help="a serving_bench.json.gz ($OUT of serving_bench; default: the newest in --results)")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "img", help="where the PNG files go")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    plot_roofline_shares(saved_gpu_runs(args.results), args.out / "roofline_shares.png")
    print(f"wrote {args.out / 'roofline_shares.png'}")
    serving = args.serving or newest_serving_run(args.results)
    if serving is None:
        print("no serving curves: no serving_bench_*.json.gz in the results; give --serving a serving_bench.json.gz "
              "(OUT=dir python -m bench.serving_bench ...)")  # fmt: skip
        return
    with gzip.open(serving, "rt") as f:
        plot_serving_curves(json.load(f), args.out / "serving_curves.png")
    print(f"wrote {args.out / 'serving_curves.png'}")


if __name__ == "__main__":
    main()
