"""transformers' continuous batching as the peer of gpu_bench: a LlamaForCausalLM over the same
random weights (views, no copy) and its offline runs, timed like ours."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from bench import log
from bench.offline_runs import Row
from bench.workloads import prompts_for


def transformers_model(hf_cfg: dict[str, Any], cfg: Any, weights: dict[str, torch.Tensor], device: torch.device) -> Any:
    """A LlamaForCausalLM whose parameters are views of `weights` (no copy)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in hf_cfg.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    views: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name.endswith("qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            views[base + "q_proj.weight"] = t[:q]
            views[base + "k_proj.weight"] = t[q : q + kv]
            views[base + "v_proj.weight"] = t[q + kv :]
        elif name.endswith("gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            views[base + "gate_proj.weight"] = t[:inter]
            views[base + "up_proj.weight"] = t[inter:]
        else:
            views[name] = t
    for name, t in views.items():
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(t, requires_grad=False))
    rotary = model.model.rotary_emb
    with torch.device(device):  # its inv_freq buffers were made on the meta device too
        model.model.rotary_emb = type(rotary)(config)
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if left:
        raise RuntimeError(f"transformers model: tensors left on the meta device: {left[:5]}")
    return model.eval()


def hf_offline(model: Any, inputs: list[list[int]], output: int) -> tuple[float, int, str]:
    """(seconds, output tokens, how) for transformers' continuous batching on `inputs`.

    Timed like ours: from handing over the requests to the last result, with the
    manager made and warmed up (CUDA graphs captured) beforehand. Falls back to
    timing a whole `generate_batch` call where the manager API differs."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=output, do_sample=False, eos_token_id=None, pad_token_id=0)
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        hints = WorkloadHints(max_prompt_length=max(map(len, inputs)), max_generated_length=output,
                              num_requests=len(inputs))  # fmt: skip
        manager = model.init_continuous_batching(generation_config=gen, workload_hints=hints)
    except (ImportError, TypeError, AttributeError):
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=inputs, generation_config=gen)
        seconds = time.perf_counter() - t0
        return seconds, sum(len(r.generated_tokens or []) for r in out.values()), "generate_batch (setup timed)"
    if hasattr(manager, "warmup"):
        manager.warmup()
    manager.start()
    try:
        t0 = time.perf_counter()
        ids = manager.add_requests(inputs=inputs, max_new_tokens=output)
        done: dict[str, Any] = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped")
        seconds = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=10)
        if hasattr(manager, "destroy"):
            manager.destroy()
    return seconds, sum(len(r.generated_tokens or []) for r in done.values()), "continuous batching manager"


def bench_transformers(model: Any, rows: list[Row], workloads: list[tuple[int, int, int, int]], vocab: int,
                       budget_s: float, save: Any) -> None:  # fmt: skip
    start = time.perf_counter()
    # Cheapest first, so a spent time budget skips the longest run.
    order = sorted(zip(rows, workloads, strict=True), key=lambda rw: (rw[1][1] * rw[1][3], rw[1][0]))
    for row, (prompt, output, _, n) in order:
        if time.perf_counter() - start > budget_s:
            row.hf_error = "not run (time budget)"
            continue
        try:
            row.hf_seconds, row.hf_output_tokens, how = hf_offline(model, prompts_for(n, prompt, vocab, 1), output)
        except Exception as e:  # report what transformers could not do, keep the table
            row.hf_error = f"{type(e).__name__}: {str(e)[:120]}"
            log(f"transformers {row.workload}: failed: {row.hf_error}")
            continue
        row.hf_requests = n
        log(f"transformers {row.workload}: {row.hf_tok_s:,.0f} tok/s ({row.hf_output_tokens} tokens "
            f"of {n * output}; {how})")  # fmt: skip
        save()
        gc.collect()
        torch.cuda.empty_cache()
