"""The decoding features give the same results on the torch backend (its launch
path, with the sampler on the device) as on the numpy reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.worker.executor.helpers import run_all
from worker.executor import (
    Executor,
    ExecutorConfig,
    GuidedDecodingParams,
    KvCacheConfig,
    OutputConfig,
    Request,
    Response,
    SamplingConfig,
)

pytest.importorskip("torch")


def requests() -> list[Request]:
    p = [30, 31, 32, 33, 34, 35]
    vocab = 320
    bias = [3.0 if t % 7 == 0 else 0.0 for t in range(vocab)]
    out = [
        Request(input_token_ids=p, max_tokens=10, end_id=-1, num_return_sequences=2,
                sampling_config=SamplingConfig(beam_width=4, length_penalty=1.0),
                output_config=OutputConfig(return_log_probs=True)),
        Request(input_token_ids=p, max_tokens=12, end_id=-1, embedding_bias=bias,
                sampling_config=SamplingConfig(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
                                               no_repeat_ngram_size=2)),
        Request(input_token_ids=p, max_tokens=12, end_id=-1, num_return_sequences=3,
                sampling_config=SamplingConfig(temperature=0.9, seed=4, top_p=0.9)),
        Request(input_token_ids=p, max_tokens=8, end_id=-1, output_config=OutputConfig(top_n_log_probs=3)),
        Request(input_token_ids=[40, 41], max_tokens=16, end_id=-1, bad_words=[[45, 46], [47]],
                sampling_config=SamplingConfig(min_tokens=4)),
    ]
    try:
        import xgrammar  # noqa: F401

        out.append(Request(input_token_ids=p, max_tokens=30, end_id=2, sampling_config=SamplingConfig(
            temperature=1.0, seed=2), guided_decoding_params=GuidedDecodingParams("regex", "(ab|cd)+!")))
    except ImportError:
        pass
    return out


def outputs(responses: list[Response]) -> list[tuple[int, list[list[int]]]]:
    """(sequence index, beams) of each result (none of these requests streams)."""
    assert all(r.result is not None for r in responses), responses[-1].error_msg
    return sorted((r.result.sequence_index, r.result.output_token_ids) for r in responses)  # type: ignore[union-attr]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_backend_matches_numpy_on_every_decoding_feature(tiny_llama: Path, device: str) -> None:
    def run(backend: str) -> list[list[Response]]:
        config = ExecutorConfig(backend=backend, device=device if backend == "torch" else None, dtype="float32",
                                max_beam_width=4, kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=4096))
        with Executor.from_model(tiny_llama, config) as ex:
            return list(run_all(ex, requests()).values())

    reference, torch_run = run("numpy"), run("torch")
    for want, got in zip(reference, torch_run, strict=True):
        assert outputs(got) == outputs(want)
        want_result, got_result = want[-1].result, got[-1].result
        assert want_result is not None and got_result is not None
        if want_result.cum_log_probs is not None:
            assert got_result.cum_log_probs is not None
            np.testing.assert_allclose(got_result.cum_log_probs, want_result.cum_log_probs, atol=1e-4)
