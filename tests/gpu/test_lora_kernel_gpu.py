"""The Triton LoRA kernels on CUDA against the torch reference (float32 math on the same
inputs): decode and prefill token counts, slots mixed with -1 or in prefill-like runs, the
fused ranks of qkv / gate_up / down, and replays of a CUDA graph with new slots and inputs.

Tolerance, ||ours - ref|| / ||ref - y0|| (the error relative to the LoRA delta, which the
cases make about as large as y): bf16 2e-2 (the intermediate is rounded to bf16 before the
expand, as Punica does, and y's bf16 rounding can land one ulp apart; expect ~4e-3), fp16
5e-3, float32 1e-5 (IEEE dots). Rows with slot -1 must be bit-identical."""

from __future__ import annotations

import pytest
import torch

from worker.backends.lora_kernel import add_lora, add_lora_reference, launch_config, plan_lora

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}
NUM_SLOTS = 16


def operands(t: int, n_in: int, n_out: int, rank: int, dtype: torch.dtype, seed: int,
             runs: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """Random slots (a quarter -1), or runs of one slot as prefill chunks have; A and B scaled
    so that the delta is of the order of y."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    if runs:
        lengths = torch.randint(1, max(2, t // 4), (t,), generator=g, device=CUDA)
        run_of = torch.repeat_interleave(torch.arange(t, device=CUDA), lengths)[:t]
        slots = torch.randint(-1, NUM_SLOTS, (t,), generator=g, device=CUDA)[run_of]
    else:
        slots = torch.randint(0, NUM_SLOTS, (t,), generator=g, device=CUDA)
        slots[torch.rand(t, generator=g, device=CUDA) < 0.25] = -1
    return {
        "y": torch.randn(t, n_out, generator=g, device=CUDA).to(dtype),
        "x": torch.randn(t, n_in, generator=g, device=CUDA).to(dtype),
        "a": (torch.randn(NUM_SLOTS, rank, n_in, generator=g, device=CUDA) / n_in**0.5).to(dtype),
        "b": (torch.randn(NUM_SLOTS, n_out, rank, generator=g, device=CUDA) / rank**0.5).to(dtype),
        "slots": slots,
    }


def apply(c: dict[str, torch.Tensor]) -> None:
    add_lora(c["y"], c["x"], c["a"], c["b"], c["slots"])


def check(c: dict[str, torch.Tensor], y0: torch.Tensor) -> float:
    """Relative error of c["y"] (after add_lora) against the reference applied to y0."""
    want = y0.clone()
    add_lora_reference(want, c["x"], c["a"], c["b"], c["slots"])
    minus_one = c["slots"] < 0
    assert torch.equal(c["y"][minus_one], y0[minus_one]), "rows with slot -1 changed"
    err = float((c["y"].float() - want.float()).norm() / (want.float() - y0.float()).norm())
    assert err < TOLERANCE[c["x"].dtype], err
    return err


# (in, out) of the 8B model's projections: qkv fused, gate_up fused, down.
SHAPES = {"qkv": (4096, 6144), "gate_up": (4096, 28672), "down": (14336, 4096)}


@pytest.mark.parametrize("t", [1, 7, 64, 1000, 5000])
@pytest.mark.parametrize("rank", [16, 48, 96])
def test_add_lora_matches_the_reference(t: int, rank: int) -> None:
    n_in, n_out = list(SHAPES.values())[(t + rank) % 3]
    c = operands(t, n_in, n_out, rank, torch.bfloat16, seed=t * 1000 + rank)
    y0 = c["y"].clone()
    apply(c)
    torch.cuda.synchronize()
    check(c, y0)


@pytest.mark.parametrize("t", [300, 5000, 16384])
def test_prefill_runs_of_one_slot(t: int) -> None:
    c = operands(t, *SHAPES["qkv"], 48, torch.bfloat16, seed=t, runs=True)
    y0 = c["y"].clone()
    apply(c)
    check(c, y0)


@pytest.mark.parametrize(("dtype", "t"), [(torch.float16, 7), (torch.float16, 700), (torch.float32, 9),
                                          (torch.float32, 900)])  # fmt: skip
def test_fp16_and_float32(dtype: torch.dtype, t: int) -> None:
    c = operands(t, 1024, 2048, 32, dtype, seed=t)
    y0 = c["y"].clone()
    apply(c)
    check(c, y0)


def test_a_rank_of_192_and_strided_rows() -> None:
    """R = 192 (gate_up at rank 96): several rank blocks in the shrink; x and y are column
    slices of wider buffers, whose other columns must not change."""
    c = operands(600, 4096, 4096, 192, torch.bfloat16, seed=5)
    wide_x = torch.randn(600, 4096 + 64, device=CUDA, dtype=torch.bfloat16)
    wide_x[:, 64:] = c["x"]
    wide_y = torch.randn(600, 4096 * 2, device=CUDA, dtype=torch.bfloat16)
    wide_y[:, 4096:] = c["y"]
    c["x"], c["y"] = wide_x[:, 64:], wide_y[:, 4096:]
    left = wide_y[:, :4096].clone()
    y0 = c["y"].clone()
    apply(c)
    check(c, y0)
    assert torch.equal(wide_y[:, :4096], left)


@pytest.mark.parametrize("t", [8, 512, 4096])
def test_replayed_in_a_cuda_graph_with_new_slots_and_inputs(t: int) -> None:
    """Captured once over fixed tensors, then their contents changed and the graph replayed:
    the plan must be recomputed on the device from the new slots (no host read)."""
    n_in, n_out = SHAPES["qkv"]
    c = operands(t, n_in, n_out, 48, torch.bfloat16, seed=t)
    assert launch_config(t, n_in, 48, NUM_SLOTS, 132).grouped == (t > 64)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles here
        apply(c)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply(c)
    for seed in (1, 2, 3):
        new = operands(t, n_in, n_out, 48, torch.bfloat16, seed=10 * t + seed, runs=seed == 3)
        for name in ("y", "x", "slots"):
            c[name].copy_(new[name])
        y0 = c["y"].clone()
        graph.replay()
        torch.cuda.synchronize()
        check(c, y0)


def test_one_plan_shared_by_every_projection_of_a_step_in_a_graph() -> None:
    """What a step does: one plan_lora, then add_lora on qkv, gate_up and down with it, all
    in one graph; replayed with new slots, every projection follows them."""
    t = 512
    ranks = {"qkv": 48, "gate_up": 32, "down": 16}
    cases = {
        name: operands(t, *SHAPES[name], rank, torch.bfloat16, seed=i) for i, (name, rank) in enumerate(ranks.items())
    }
    slots = cases["qkv"]["slots"]

    def step() -> None:
        plan = plan_lora(slots, NUM_SLOTS)
        assert plan is not None
        for c in cases.values():
            add_lora(c["y"], c["x"], c["a"], c["b"], slots, plan=plan)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    slots.copy_(operands(t, 64, 64, 16, torch.bfloat16, seed=99)["slots"])
    before = {name: c["y"].clone() for name, c in cases.items()}
    graph.replay()
    torch.cuda.synchronize()
    for name, c in cases.items():
        check({**c, "slots": slots}, before[name])
