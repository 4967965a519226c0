"""Host-side inputs to the sampler's bans and top-p decay, against hand
computations and transformers' own logits processors."""

from __future__ import annotations

import numpy as np
import pytest

from worker.executor.penalties import decayed_top_p, no_repeat_ngram_bans, seen_tokens
from worker.executor.sequence import Sequence
from worker.executor.types import Request, SamplingConfig

TOKENS = [5, 7, 5, 7, 9, 5, 7, 9, 5, 7]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_no_repeat_ngram_bans_match_transformers(n: int) -> None:
    import torch
    from transformers import NoRepeatNGramLogitsProcessor

    scores = torch.zeros(1, 12)
    processed = NoRepeatNGramLogitsProcessor(n)(torch.tensor([TOKENS]), scores)
    want = sorted(torch.nonzero(processed[0] == -float("inf")).flatten().tolist())
    assert no_repeat_ngram_bans(TOKENS, n) == want
    assert want, "nothing banned: the case shows nothing"


def test_no_repeat_ngram_by_hand() -> None:
    # after "5 7" came 5 and 2; after "... 9 5" came 7
    assert no_repeat_ngram_bans([5, 7, 5, 7, 2, 5, 7], 3) == [2, 5]
    assert no_repeat_ngram_bans([1, 2], 4) == []


def seq(tokens: list[int], prompt: int, cfg: SamplingConfig) -> Sequence:
    return Sequence(request_id=1, request=Request(input_token_ids=tokens[:prompt], max_tokens=50, sampling_config=cfg),
                    token_ids=list(tokens), num_prompt_tokens=prompt, end_id=2, stop_words=[], bad_words=[], seed=0,
                    sampling_params=(1.0, 0.0, 0.9, 0.0))


def test_seen_tokens_count_generated_occurrences_only() -> None:
    ids, counts = seen_tokens(seq([5, 7, 5, 3, 9, 5, 7, 2, 9, 5], 4, SamplingConfig()))  # generated 9 5 7 2 9 5
    assert dict(zip(ids.tolist(), counts.tolist(), strict=True)) == {2: 1, 3: 0, 5: 2, 7: 1, 9: 2}
    ids, counts = seen_tokens(seq([3, 3, 4], 3, SamplingConfig()))
    assert ids.tolist() == [3, 4] and counts.tolist() == [0, 0]


def test_top_p_decays_from_the_last_reset_token_down_to_the_floor() -> None:
    cfg = SamplingConfig(top_p=0.9, top_p_decay=0.5, top_p_min=0.2, top_p_reset_ids=9)
    # generated: 9 5 7 9 5 7 -> 2 tokens since the last 9
    assert decayed_top_p(seq(TOKENS, 4, cfg), 0.9) == pytest.approx(0.9 * 0.25)
    # no reset token: 4 generated -> 0.9 / 16 < floor
    no_reset = SamplingConfig(top_p=0.9, top_p_decay=0.5, top_p_min=0.2)
    assert decayed_top_p(seq([1, 2, 3, 4, 6, 8, 3, 1], 4, no_reset), 0.9) == 0.2
    assert decayed_top_p(seq([1, 2], 2, no_reset), 0.9) == 0.9  # first token: no decay yet
    assert np.isclose(decayed_top_p(seq([1, 2, 3], 2, SamplingConfig(top_p_decay=0.5)), 1.0), 1.0)  # top-p off
