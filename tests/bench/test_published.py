"""TensorRT-LLM's published figures: a row finds the one for its setup and workload, on the
GPU they were measured on."""

from __future__ import annotations

import pytest

from bench.published import published_tok_s


@pytest.mark.parametrize(
    ("gpu", "shape", "quantization", "tensor_parallel", "workload", "figure"),
    [
        ("NVIDIA H200", "8b", "fp8", 1, "1000/1000", 17_744),
        ("NVIDIA H200", "8b", "fp8", 1, "2048/2048", 12_194),
        ("NVIDIA H200", "70b", "fp8", 2, "128/2048", 8_464),
        ("NVIDIA H200", "70b", "fp8", 2, "2048/2048", None),  # not published at TP=2
        ("NVIDIA H200", "8b", None, 1, "128/128", None),  # bf16: not published
        ("NVIDIA H200", "8b", "fp8", 2, "128/128", None),
        ("NVIDIA H100 80GB HBM3", "8b", "fp8", 1, "128/128", None),  # the H200's figures are no H100's
        ("cpu", "8b", "fp8", 1, "128/128", None),
    ],
)
def test_a_row_finds_the_figure_of_its_own_setup(gpu: str, shape: str, quantization: str | None, tensor_parallel: int,
                                                 workload: str, figure: int | None) -> None:  # fmt: skip
    assert published_tok_s(gpu, shape, quantization, tensor_parallel, workload) == figure
