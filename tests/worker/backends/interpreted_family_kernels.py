"""The kernels of the families beyond Llama, the per-head q/k RMSNorm
(worker/backends/head_norm.py) and GeGLU (worker/backends/gelu_mul.py), run by Triton's
interpreter on the CPU against their torch twins, in float32 and bf16 (run with
TRITON_INTERPRET=1 set before Triton is imported: test_family_kernels_interpreted.py
starts this module in a process of its own).

    TRITON_INTERPRET=1 python -m tests.worker.backends.interpreted_family_kernels
"""

from __future__ import annotations

import os
import sys

import torch

from tests.worker.backends.interpreted_kernels import UNIT, gamma
from worker.backends.gelu_mul import gelu_tanh_mul_torch, gelu_tanh_mul_triton
from worker.backends.head_norm import head_norm_torch, head_norm_triton


def check_head_norm() -> None:
    # Qwen3's grouped heads (and a head_dim not a power of two), Gemma 3's 256-wide heads.
    for heads, kv_heads, dim, dtype in ((4, 2, 24, torch.float32), (2, 1, 256, torch.float32),
                                        (4, 2, 32, torch.bfloat16)):  # fmt: skip
        for t in (1, 9):
            qkv = torch.randn(t, (heads + 2 * kv_heads) * dim).to(dtype)
            q_w, k_w = torch.randn(dim).to(dtype), torch.randn(dim).to(dtype)
            want = head_norm_torch(qkv, q_w, k_w, 1e-6, heads, kv_heads, dim)
            got = head_norm_triton(qkv.clone(), q_w, k_w, 1e-6, heads, kv_heads, dim)
            v = slice((heads + kv_heads) * dim, None)
            assert torch.equal(got[:, v], qkv[:, v]), "v changed"
            if dtype == torch.float32:
                # the mean of `dim` squares within gamma(dim + 1), its rsqrt within half that, a few roundings more
                torch.testing.assert_close(got, want, atol=1e-5, rtol=gamma(dim + 1) + 8 * UNIT)
            else:
                # float32 norms a rounding apart may round the normalized head to neighbouring bf16
                # values (one ulp, 2^-7 of it), and the product with the weight rounds once more
                torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=2**-6)


def check_gelu_tanh_mul() -> None:
    # wider than one program's block; values far into both tails, where tanh saturates
    gate_up = torch.cat([torch.randn(5, 1500) * 3, torch.randn(5, 1500)], dim=1)
    gate_up[0, :4] = torch.tensor([-30.0, -9.0, 9.0, 30.0])
    for dtype in (torch.float32, torch.bfloat16):
        x = gate_up.to(dtype)
        got, want = gelu_tanh_mul_triton(x).float(), gelu_tanh_mul_torch(x).float()
        if dtype == torch.float32:
            # tanh from exp here, torch's own tanh there: a few float32 roundings apart, and
            # 1 + tanh loses up to 1e-7 absolute where tanh is near -1 (its GELU is near 0)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:
            # the float32 GELUs may round to neighbouring bf16 values, and the product rounds again
            torch.testing.assert_close(got, want, atol=1e-5, rtol=2**-6)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1: the kernels must run in Triton's interpreter", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    for check in (check_head_norm, check_gelu_tanh_mul):
        check()
        print(f"{check.__name__}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
