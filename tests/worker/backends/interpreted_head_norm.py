"""The per-head q/k RMSNorm kernel (worker/backends/head_norm.py) run by Triton's
interpreter on the CPU against its torch twin, in float32 and bf16 (run with
TRITON_INTERPRET=1 set before Triton is imported: test_head_norm_interpreted.py starts
this module in a process of its own).

    TRITON_INTERPRET=1 python -m tests.worker.backends.interpreted_head_norm
"""

from __future__ import annotations

import os
import sys

import torch

from tests.worker.backends.interpreted_kernels import UNIT, gamma
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


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1: the kernel must run in Triton's interpreter", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    check_head_norm()
    print("check_head_norm: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
