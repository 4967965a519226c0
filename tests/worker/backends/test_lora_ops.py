"""The LoRA delta of the torch ops: per-slot GEMMs on the CPU, and the gathered form that
float32 CUDA graphs capture, agree; rows with slot -1 are left alone."""

from __future__ import annotations

import torch

from worker.backends.torch_decoder_ops import _add_lora_cpu, _add_lora_gathered


def test_per_slot_and_gathered_deltas_agree_and_skip_rows_without_an_adapter() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 6, 10, generator=g), torch.randn(3, 7, 6, generator=g)  # 3 slots, rank 6
    x, y = torch.randn(9, 10, generator=g), torch.randn(9, 7, generator=g)
    slots = torch.tensor([0, -1, 2, 2, 1, -1, 0, 1, 2])
    per_slot, gathered = y.clone(), y.clone()
    _add_lora_cpu(per_slot, x, a, b, slots)
    _add_lora_gathered(gathered, x, a, b, slots)
    want = y + torch.stack([(x[t] @ a[s].T) @ b[s].T if s >= 0 else torch.zeros(7) for t, s in enumerate(slots)])
    torch.testing.assert_close(per_slot, want)
    torch.testing.assert_close(gathered, want)
    assert torch.equal(per_slot[[1, 5]], y[[1, 5]])
