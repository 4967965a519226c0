"""The numpy sampler, rule by rule, against a direct per-row computation."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from worker.backends.base import SamplingBatch
from worker.backends.numpy_sampler import sample

LOGITS = np.array([1.0, 3.0, 0.5, 2.5, -1.0, 2.9, 0.0, 1.5], dtype=np.float32)


def batch(rows: int, **params: object) -> SamplingBatch:
    def col(name: str, default: float, dtype: type) -> np.ndarray:
        value = params.get(name, default)
        return np.broadcast_to(np.asarray(value, dtype=dtype), (rows,)).copy()

    bans = params.get("bans", [])
    assert isinstance(bans, list)
    return SamplingBatch(
        temperature=col("temperature", 1.0, np.float32),
        top_k=col("top_k", 0, np.int64),
        top_p=col("top_p", 1.0, np.float32),
        min_p=col("min_p", 0.0, np.float32),
        uniform=col("uniform", 0.5, np.float64),
        ban_rows=np.asarray([r for r, _ in bans], dtype=np.int64),
        ban_tokens=np.asarray([t for _, t in bans], dtype=np.int64),
    )


def by_hand(logits: np.ndarray, u: float, t: float = 1.0, k: int = 0, p: float = 1.0, min_p: float = 0.0) -> int:
    """Keep/renormalise step by step with plain Python, then invert the CDF over token ids."""
    scores = [float(x) / t for x in logits]
    kept = set(range(len(scores)))
    if k:
        kth = sorted(scores, reverse=True)[k - 1]
        kept = {i for i in kept if scores[i] >= kth}

    def probs() -> dict[int, float]:
        z = sum(np.exp(scores[i]) for i in kept)
        return {i: float(np.exp(scores[i]) / z) for i in kept}

    if p < 1.0:
        mass, chosen = 0.0, set()
        for i in sorted(kept, key=lambda i: -scores[i]):
            if mass >= p:
                break
            chosen.add(i)
            mass += probs()[i]
        kept = chosen
    if min_p:
        pr = probs()
        kept = {i for i in kept if pr[i] >= min_p * max(pr.values())}
    pr = probs()
    cum = 0.0
    for i in sorted(kept):
        cum += pr[i]
        if cum > u:
            return i
    return max(kept)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - np.log(np.exp(x - x.max()).sum()) - x.max()


UNIFORMS = [0.0, 0.05, 0.3, 0.5, 0.77, 0.95, 0.999]


def test_greedy_is_argmax_with_log_prob() -> None:
    out = sample(LOGITS[None], batch(1, temperature=0.0))
    assert out.token_ids.tolist() == [1]
    assert out.log_probs[0] == pytest.approx(log_softmax(LOGITS)[1], abs=1e-6)


def test_bans_apply_to_greedy_and_sampled_rows() -> None:
    logits = np.stack([LOGITS, LOGITS])
    params = batch(2, temperature=[0.0, 1.0], bans=[(0, 1), (0, 5), (1, 1)], uniform=[0.5, 0.0])
    out = sample(logits, params)
    assert out.token_ids[0] == 3  # 1 and 5 banned: next best
    banned = LOGITS.copy()
    banned[[1, 5]] = -np.inf
    assert out.log_probs[0] == pytest.approx(log_softmax(banned)[3], abs=1e-6)
    for u in np.linspace(0, 0.999, 50):
        assert sample(logits, batch(2, temperature=1.0, uniform=u, bans=[(0, 1), (1, 1)])).token_ids.tolist() != [1, 1]


@pytest.mark.parametrize("u", UNIFORMS)
@pytest.mark.parametrize(
    "rule",
    [
        {"t": 1.0},
        {"t": 0.5},
        {"t": 2.0},
        {"k": 3},
        {"k": 1},
        {"p": 0.6},
        {"p": 0.9, "t": 0.7},
        {"min_p": 0.3},
        {"k": 4, "p": 0.8, "min_p": 0.1, "t": 1.3},
    ],
    ids=str,
)
def test_each_rule_matches_hand_computation(rule: dict[str, float], u: float) -> None:
    params = batch(
        1,
        temperature=rule.get("t", 1.0),
        top_k=rule.get("k", 0),
        top_p=rule.get("p", 1.0),
        min_p=rule.get("min_p", 0.0),
        uniform=u,
    )
    out = sample(LOGITS[None], params)
    want = by_hand(LOGITS, u, **rule)  # type: ignore[arg-type]
    assert int(out.token_ids[0]) == want
    # log probs are of the raw (banned) logits, whatever the temperature and filters
    assert out.log_probs[0] == pytest.approx(log_softmax(LOGITS)[want], abs=1e-6)


def test_filters_keep_only_their_tokens() -> None:
    draws = np.linspace(0, 0.999, 200)
    n = len(draws)
    logits = np.broadcast_to(LOGITS, (n, LOGITS.size))
    assert set(sample(logits, batch(n, top_k=2, uniform=draws)).token_ids.tolist()) == {1, 5}
    # p(1) + p(5) is about 0.52 of the mass: top_p 0.5 keeps exactly those two
    assert set(sample(logits, batch(n, top_p=0.5, uniform=draws)).token_ids.tolist()) == {1, 5}
    everything = set(sample(logits, batch(n, uniform=draws)).token_ids.tolist())
    assert everything == set(range(LOGITS.size))


def test_rows_do_not_depend_on_their_neighbours() -> None:
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((6, 50)).astype(np.float32) * 3
    params = batch(
        6,
        temperature=[0.0, 0.8, 1.0, 1.2, 0.7, 1.0],
        top_k=[0, 5, 0, 10, 0, 3],
        top_p=[1.0, 1.0, 0.9, 0.8, 1.0, 0.95],
        min_p=[0.0, 0.0, 0.0, 0.05, 0.2, 0.0],
        uniform=rng.random(6),
    )
    together = sample(logits, params)
    for row in range(6):
        alone = sample(
            logits[row : row + 1],
            SamplingBatch(
                temperature=params.temperature[row : row + 1],
                top_k=params.top_k[row : row + 1],
                top_p=params.top_p[row : row + 1],
                min_p=params.min_p[row : row + 1],
                uniform=params.uniform[row : row + 1],
                ban_rows=np.zeros(0, dtype=np.int64),
                ban_tokens=np.zeros(0, dtype=np.int64),
            ),
        )
        assert alone.token_ids[0] == together.token_ids[row]
        assert alone.log_probs[0] == together.log_probs[row]
    again = sample(logits, params)  # same draws, same tokens
    np.testing.assert_array_equal(again.token_ids, together.token_ids)


def test_seeded_draws_reproduce_distribution() -> None:
    rng = np.random.default_rng(0)
    n = 20000
    out = sample(np.broadcast_to(LOGITS, (n, LOGITS.size)), batch(n, uniform=rng.random(n)))
    freq = np.bincount(out.token_ids, minlength=LOGITS.size) / n
    expected = np.exp(log_softmax(LOGITS))
    np.testing.assert_allclose(freq, expected, atol=0.015)


# -- processed logits: bias, penalties, grammar mask, top-N --------------------------------


def with_fields(params: SamplingBatch, **fields: object) -> SamplingBatch:
    return replace(params, **fields)  # type: ignore[arg-type]


def test_bias_and_penalties_match_a_hand_computation() -> None:
    """Row 0: bias; row 1: repetition 2 on tokens 1 (generated twice) and 4 (prompt
    only); row 2: presence 0.5 and frequency 0.3 on the same tokens."""
    logits = np.stack([LOGITS, LOGITS, LOGITS])
    bias = np.zeros((1, LOGITS.size), dtype=np.float32)
    bias[0, [0, 6]] = [5.0, -2.0]
    params = with_fields(
        batch(3, temperature=0.0),
        bias_rows=np.array([0]),
        bias=bias,
        repetition_penalty=np.array([1.0, 2.0, 1.0], dtype=np.float32),
        presence_penalty=np.array([0.0, 0.0, 0.5], dtype=np.float32),
        frequency_penalty=np.array([0.0, 0.0, 0.3], dtype=np.float32),
        seen_rows=np.array([1, 1, 2, 2]),
        seen_tokens=np.array([1, 4, 1, 4]),
        seen_counts=np.array([2, 0, 2, 0]),
        top_n=LOGITS.size,
    )
    want = np.stack([LOGITS, LOGITS, LOGITS]).astype(np.float64)
    want[0, 0] += 5.0
    want[0, 6] -= 2.0
    want[1, 1] = 3.0 / 2.0  # positive: divided
    want[1, 4] = -1.0 * 2.0  # negative: multiplied
    want[2, 1] = 3.0 - 0.5 - 0.3 * 2  # generated twice
    want[2, 4] = -1.0  # only in the prompt: no presence or frequency
    out = sample(logits, params)
    assert out.token_ids.tolist() == [int(np.argmax(w)) for w in want]
    assert out.top_tokens is not None and out.top_log_probs is not None
    for row in range(3):
        lp = log_softmax(want[row])
        np.testing.assert_array_equal(out.top_tokens[row], np.argsort(-want[row], kind="stable"))
        np.testing.assert_allclose(out.top_log_probs[row], lp[out.top_tokens[row]], atol=1e-6)
        assert out.log_probs[row] == pytest.approx(lp[out.token_ids[row]], abs=1e-6)


def test_grammar_mask_allows_only_its_tokens_in_greedy_and_sampled_rows() -> None:
    n = 64
    allowed = [0, 4, 6]  # three of the least likely tokens
    words = np.zeros((n, 1), dtype=np.int32)
    words[:, 0] = sum(1 << t for t in allowed)
    params = with_fields(
        batch(n, temperature=[0.0] + [1.0] * (n - 1), uniform=np.linspace(0, 0.999, n)),
        mask_rows=np.arange(n),
        token_mask=words,
    )
    out = sample(np.broadcast_to(LOGITS, (n, LOGITS.size)), params)
    assert out.token_ids[0] == 0  # the best allowed one
    assert set(out.token_ids.tolist()) == set(allowed)
    masked = np.full(LOGITS.size, -np.inf)
    masked[allowed] = LOGITS[allowed]
    assert out.log_probs[0] == pytest.approx(log_softmax(masked)[0], abs=1e-6)


def test_top_n_orders_ties_by_token_id() -> None:
    logits = np.array([[1.0, 2.0, 2.0, 0.0, 2.0]], dtype=np.float32)
    out = sample(logits, with_fields(batch(1, temperature=0.0), top_n=4))
    assert out.top_tokens is not None and out.top_tokens[0].tolist() == [1, 2, 4, 0]
