import numpy as np
import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from worker.models import mxfp4


def test_e2m1_codes_are_the_formats_sixteen_values() -> None:
    assert mxfp4.E2M1.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                   -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]  # fmt: skip


def test_one_block_by_hand() -> None:
    # element 0 in the low nibble of byte 0: code 0b0011 = 1.5; element 1 in its high nibble: 0b1101 = -3
    blocks = np.zeros((1, 16), np.uint8)
    blocks[0, 0] = 0b1101_0011
    scales = np.array([127 + 2], np.uint8)  # 2 ** 2
    values = mxfp4.dequantize(blocks, scales)
    assert values.shape == (32,)
    assert values[:2].tolist() == [6.0, -12.0]
    assert not values[2:].any()


def test_matches_transformers_on_every_code_and_a_range_of_scales() -> None:
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 8, 4, 16), dtype=np.uint8)  # [experts, rows, groups, 16]
    scales = rng.integers(127 - 20, 127 + 8, size=(3, 8, 4), dtype=np.uint8)
    ours = mxfp4.dequantize(blocks, scales)
    # transformers dequantizes and transposes to its [experts, in, out] layout
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(ours, theirs.transpose(1, 2).numpy())


def test_nan_scale_and_bad_shapes() -> None:
    values = mxfp4.dequantize(np.full((1, 16), 0x22, np.uint8), np.array([255], np.uint8))
    assert np.isnan(values).all()
    with pytest.raises(ValueError, match="do not match scales"):
        mxfp4.dequantize(np.zeros((2, 16), np.uint8), np.zeros((3,), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.dequantize(np.zeros((1, 16), np.int8), np.zeros((1,), np.uint8))
