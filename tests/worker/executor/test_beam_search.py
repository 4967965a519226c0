"""Beam search bookkeeping on hand-made candidates (end to end parity with
transformers is in test_decoding.py)."""

from __future__ import annotations

import numpy as np
import pytest

from worker.executor.beam_search import BeamSearch
from worker.executor.types import FinishReason

END = 9


def ends(beam: int, token: int) -> FinishReason:
    return FinishReason.END_ID if token == END else FinishReason.NOT_FINISHED


def test_steps_keep_the_best_cumulative_beams_and_finish_on_the_end_token() -> None:
    search = BeamSearch(width=2, max_tokens=10, length_penalty=1.0, early_stopping=1)
    # first step: one beam; candidates 3 (-0.1), 4 (-0.5), 9 (-0.7), 6 (-2)
    first = search.step(np.array([[3, 4, 9, 6]]), np.log(np.exp(np.array([[-0.1, -0.5, -0.7, -2.0]]))),
                        [[]], [[]], ends)
    assert [(c.parent, c.token) for c in first] == [(0, 3), (0, 4)]
    # second step: beam 0 (-0.1) ends best with 9 (-0.1 - 0.2); beam 1 (-0.5) goes on with 1
    second = search.step(np.array([[9, 5, 6, 7], [1, 2, 8, 0]]),
                         np.array([[-0.2, -1.0, -3.0, -4.0], [-0.3, -0.4, -3.0, -5.0]]),
                         [[3], [4]], [[-0.1], [-0.5]], ends)
    assert [(c.parent, c.token) for c in second] == [(1, 1), (1, 2)]
    assert len(search.finished) == 1
    hyp = search.finished[0]
    assert hyp.tokens == [3, 9] and hyp.reason is FinishReason.END_ID
    assert hyp.score == pytest.approx((-0.1 - 0.2) / 2)
    assert not search.done


def test_max_tokens_finishes_the_best_width_beams() -> None:
    search = BeamSearch(width=2, max_tokens=1, length_penalty=0.0)
    search.step(np.array([[3, 4, 5, 6]]), np.array([[-0.1, -0.2, -0.3, -0.4]]), [[]], [[]], ends)
    assert search.done
    assert [(h.tokens, h.reason) for h in search.finished] == [([3], FinishReason.LENGTH), ([4], FinishReason.LENGTH)]


def test_diversity_rate_lowers_each_beams_kth_candidate_by_rate_times_k() -> None:
    tokens = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    log_probs = np.array([[-0.1, -0.2, -5.0, -6.0], [-0.6, -0.7, -5.0, -6.0]])
    plain = BeamSearch(width=2, max_tokens=10, scores=np.array([0.0, 0.0]))
    assert [c.token for c in plain.step(tokens, log_probs, [[0], [0]], [[0.0], [0.0]], ends)] == [1, 2]
    diverse = BeamSearch(width=2, max_tokens=10, diversity_rate=1.0, scores=np.array([0.0, 0.0]))
    # ranked: 1 -> -0.1, 2 -> -0.2 - 1 = -1.2, 5 -> -0.6, 6 -> -1.7: the second beam's best wins over 2
    picked = diverse.step(tokens, log_probs, [[0], [0]], [[0.0], [0.0]], ends)
    assert [c.token for c in picked] == [1, 5]
    assert [c.score for c in picked] == pytest.approx([-0.1, -0.6])


def test_early_stopping_heuristic_stops_when_no_running_beam_can_win() -> None:
    search = BeamSearch(width=1, max_tokens=10, length_penalty=1.0, early_stopping=0)
    # the end token is best: one hypothesis at -0.1; the runner-up beam is at -2 < -0.1
    search.step(np.array([[END, 4]]), np.array([[-0.1, -2.0]]), [[]], [[]], ends)
    assert len(search.finished) == 1 and search.done
