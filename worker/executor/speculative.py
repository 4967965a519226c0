"""Speculative decoding: which requests speculate, the draft sources that need no
model (the request's own draft tokens, prompt lookup), and the acceptance rule.

A speculating sequence's generation step carries [last token, d1 .. dk]. The
forward writes the KV of all k + 1 positions and returns logits for each; row j
is sampled with the request's own sampling parameters and the counter-based
uniform draw of the output position that row decides (`uniform_draws(seed,
sequence_index, num_generated + j)`), exactly the draw ordinary decoding uses
for that position. The step keeps target tokens t0 .. tn, where n is the number
of leading drafts with d(j+1) == tj: the accepted drafts, then the target's own
token after them (a correction, or a bonus token when all k are accepted).

Why the output is ordinary decoding's. Every draft source here is deterministic
given the tokens so far (the caller's tokens, an n-gram match, a greedy draft
model): the proposal is a point mass q(d) = 1. The standard rejection rule
(Leviathan et al. 2023; Chen et al. 2023) accepts d with probability
min(1, p(d) / q(d)) = p(d) and on rejection samples from norm(max(0, p - q)),
which is p with d removed; accepting "d equals a sample tj ~ p" and otherwise
keeping tj (which is then ~ p given tj != d) is the same rule. Beyond the
distribution, rows are sampled with the very draws ordinary decoding would use
at those output positions, so row j's token is the token ordinary decoding picks
at position num_generated + j from the same prefix whenever d1 .. dj were
accepted: greedy and seeded sampling give token-identical output with speculation
on or off. Where it can differ: the verification forward computes k + 1
positions in one pass (a different reduction order than k + 1 single-token
steps, like any chunked prefill), so logits may differ in the last bits, which
flips a choice only on an exact near-tie (argmax ties, or a draw within rounding
of a CDF boundary). Rows of one step never influence each other, so requests
whose sampling depends on earlier tokens of the same step do not speculate:
see `off_reason`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from worker.executor.penalties import needs_known_tokens
from worker.executor.sequence import Sequence
from worker.executor.types import DraftSource, Request, SpeculativeConfig

MAX_DRAFT_TOKENS = 16


@dataclass(slots=True)
class SpecState:
    """One sequence's speculation: its config and its acceptance counts."""

    config: SpeculativeConfig
    num_drafted: int = 0  # draft tokens verified
    num_accepted: int = 0  # draft tokens accepted
    # DRAFT_TOKENS: how many output tokens were checked against the caller's, and
    # whether the output stopped following them.
    checked: int = 0
    diverged: bool = False
    # PROMPT_LOOKUP: the tokens so far as an array, extended as they grow (converting
    # a long list on every step would cost more than the search).
    array: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    filled: int = 0

    def tokens_array(self, tokens: list[int]) -> np.ndarray:
        """`tokens` (which only ever grow) as an array."""
        n = len(tokens)
        if n > len(self.array):
            grown = np.zeros(2 * n, dtype=np.int64)
            grown[: self.filled] = self.array[: self.filled]
            self.array = grown
        self.array[self.filled : n] = tokens[self.filled : n]
        self.filled = n
        return self.array[:n]


def off_reason(request: Request, config: SpeculativeConfig, has_draft_model: bool) -> str | None:
    """Why this request cannot speculate (None: it can). Rows of a verification step
    are sampled together, so nothing may depend on a token sampled in the same step;
    outputs computed on the host per step are left to ordinary decoding."""
    cfg = request.sampling_config
    out = request.output_config
    checks = (
        ("beam search", cfg.beam_width > 1),
        ("num_return_sequences > 1", request.num_return_sequences > 1),
        ("guided decoding", request.guided_decoding_params is not None),
        ("a logits post-processor", request.logits_post_processor_name is not None),
        ("generation logits", out.return_generation_logits),
        ("context logits", out.return_context_logits),
        ("top-p decay", cfg.top_p_decay is not None),
        # Prompt lookup would propose table rows' ids as tokens, a draft model cannot read them.
        ("prompt tuning", request.prompt_tuning_config is not None),
        ("no draft model loaded", config.source is DraftSource.DRAFT_MODEL and not has_draft_model),
        ("no draft tokens given", config.source is DraftSource.DRAFT_TOKENS and not config.draft_tokens),
    )
    for reason, applies in checks:
        if applies:
            return reason
    return None


def off_reason_for_tokens(seq: Sequence) -> str | None:
    """Penalties, no-repeat n-grams and multi-token bad words read the tokens
    before each row (needs_known_tokens)."""
    if needs_known_tokens(seq):
        return "penalties, no-repeat n-grams or multi-token bad words"
    return None


def validate(config: SpeculativeConfig, vocab_size: int) -> str | None:
    """What is wrong with a speculative config (None: nothing)."""
    if not 0 <= config.num_draft_tokens <= MAX_DRAFT_TOKENS:
        return f"speculative_config.num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}], got {config.num_draft_tokens}"
    if not 1 <= config.min_ngram <= config.max_ngram:
        return (f"speculative_config needs 1 <= min_ngram <= max_ngram, "
                f"got {config.min_ngram}, {config.max_ngram}")
    if config.draft_tokens and any(not 0 <= t < vocab_size for t in config.draft_tokens):
        return f"speculative_config.draft_tokens: a token id is outside the vocabulary [0, {vocab_size})"
    return None


def max_drafts(seq: Sequence, max_seq_len: int) -> int:
    """The most drafts this step may carry: all k + 1 sampled tokens stay within
    max_tokens and the context, and min_tokens (an end-token ban that depends on the
    position) is already met."""
    assert seq.spec is not None
    cfg = seq.request.sampling_config
    if seq.num_generated < (cfg.min_tokens or 0):
        return 0
    room = min(seq.request.max_tokens - seq.num_generated, max_seq_len - seq.num_tokens) - 1
    return max(0, min(seq.spec.config.num_draft_tokens, room))


def prompt_lookup(tokens: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest
    suffix n-gram (max_ngram down to min_ngram) of `tokens`."""
    length = len(tokens)
    if k <= 0 or length < min_ngram + 1:
        return []
    # Where an earlier token equals the last one, then, one token further back at a
    # time, where the match goes on: the positions ending the longest match.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    best = ends if min_ngram <= 1 else ends[:0]
    for j in range(1, max_ngram):
        ends = ends[ends >= j]
        ends = ends[tokens[ends - j] == tokens[length - 1 - j]]
        if not ends.size:
            break
        if j + 1 >= min_ngram:
            best = ends
    if not best.size:
        return []
    start = int(best[-1]) + 1
    return [int(t) for t in tokens[start : start + k]]


def external_drafts(state: SpecState, generated: list[int], k: int) -> list[int]:
    """The caller's expected continuation after the output so far, while the output follows it."""
    expected = state.config.draft_tokens or []
    g = len(generated)
    if state.diverged or g >= len(expected):
        return []
    # Only the tokens since the last check can have left the caller's: compare those.
    if generated[state.checked : g] != expected[state.checked : g]:
        state.diverged = True
        return []
    state.checked = g
    return expected[g : g + k]


def num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts equal the target's own tokens (sampled[j] decides draft j + 1)."""
    n = 0
    for d, t in zip(drafts, sampled, strict=False):
        if d != t:
            break
        n += 1
    return n
