"""The choice between cuBLAS and the Triton FP8 GEMM (fp8_gemm.choose), and which products
the kernel takes. The kernel's arithmetic is checked in Triton's interpreter
(interpreted_kernels.check_fp8_gemm) and against cuBLAS on the GPU (tests/gpu/test_quant_gpu.py)."""

from __future__ import annotations

import pytest

from worker.backends import fp8_gemm
from worker.backends.fp8_gemm import MARGIN, TILES, choose


def test_a_clearly_faster_tile_replaces_cublas() -> None:
    # the H100's qkv at 256 rows: cuBLAS 43.4 us, the best tile 23.9
    timings = {TILES[0]: 30.0, TILES[2]: 23.9, TILES[3]: 26.0}
    assert choose(43.4, timings) == TILES[2]


def test_a_near_tie_or_a_loss_keeps_cublas() -> None:
    assert choose(20.0, {TILES[0]: 20.0 * MARGIN * 1.01, TILES[1]: 25.0}) is None
    assert choose(17.7, {TILES[0]: 24.0}) is None  # o at 256 rows: cuBLAS wins


def test_no_tile_that_ran_keeps_cublas() -> None:
    assert choose(10.0, {}) is None  # every tile failed to compile or launch on this device


def test_the_margin_itself_is_a_win() -> None:
    assert choose(10.0, {TILES[1]: 10.0 * MARGIN}) == TILES[1]


@pytest.mark.skipif(fp8_gemm.triton is None, reason="needs Triton")
@pytest.mark.parametrize(("rows", "k", "taken"), [(256, 4096, True), (16, 14336, True), (2, 4096, True),
                                                  (1, 4096, False), (256, 4000, False)])  # fmt: skip
def test_the_kernel_takes_whole_k_tiles_and_two_rows_or_more(rows: int, k: int, taken: bool) -> None:
    assert fp8_gemm.supports(rows, k) is taken  # one row is the GEMV's


def test_a_split_tile_takes_whole_k_tiles_in_every_part_and_few_rows() -> None:
    split4 = fp8_gemm.Tile(64, 64, 4, 4, split_k=4)
    assert fp8_gemm.takes(split4, 16, 14336)  # 112 tiles of 128 inputs: 28 a part
    assert not fp8_gemm.takes(split4, 16, 128 * 6)  # 6 tiles do not split 4 ways
    assert not fp8_gemm.takes(split4, fp8_gemm.MAX_SPLIT_ROWS + 1, 4096)
    assert fp8_gemm.takes(TILES[0], fp8_gemm.MAX_SPLIT_ROWS + 1, 4096)  # unsplit tiles take any row count


def test_a_row_counts_timings_on_one_line() -> None:
    split = fp8_gemm.Tile(64, 64, 4, 4, split_k=4)
    timings = [fp8_gemm.Timing(448, 6144, 4096, 34.8, 23.1, TILES[2], TILES[2]),
               fp8_gemm.Timing(448, 4096, 4096, 16.0, 16.5, TILES[0], None),
               fp8_gemm.Timing(16, 4096, 14336, 38.1, 22.0, split, split)]  # fmt: skip
    assert fp8_gemm.describe(timings) == ("6144x4096 34.8 / 23.1 -> Triton 64x128; 4096x4096 16.0 / 16.5; "
                                          "4096x14336 38.1 / 22.0 -> Triton 64x64/4")
