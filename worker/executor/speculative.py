"""Speculative decoding: which requests speculate, the draft sources that need no
model (the request's own draft tokens, prompt lookup), and the acceptance rule.
`Speculation` holds both ends of it for the engine: it proposes the drafts before
each schedule (draft_model.py for a draft model) and keeps what a verification
step accepts when that step completes, so proposing and accepting stay together.

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
positions in one pass, a different reduction order than k + 1 single-token steps
(cuBLAS picks other kernels for k + 1 rows than for one; the attention splits its
keys differently), like any chunked prefill. What holds, measured:
- float32 (the CPU backends, and CUDA with dtype float32): token-identical, greedy
  and seeded (tests/worker/executor/test_speculative.py, tests/gpu/test_speculative_gpu.py);
- bf16 on CUDA: the logits differ by bf16 rounding, so a choice flips only at a
  near-tie. tests/gpu/test_speculative_gpu.py asserts that every greedy divergence
  on the tiny checkpoint is where the float32 logits of the two tokens lie within
  2 % of the largest logit; bench/spec_bench.py's "identical" column counts the
  default model's requests whose output equals ordinary decoding's.
Exact bf16 equality would need batch-invariant GEMM and attention kernels (one
reduction order whatever the number of rows); tokenwire has none.
Rows of one step never influence each other, so requests whose sampling depends
on earlier tokens of the same step do not speculate: see `off_reason`.
"""

from __future__ import annotations

from array import array

import numpy as np

from worker.executor.block_manager import BlockManager
from worker.executor.draft_model import DraftModel
from worker.executor.penalties import needs_known_tokens
from worker.executor.sequence import Sequence
from worker.executor.spec_state import INT32, SpecState
from worker.executor.stop_rules import finish_reason
from worker.executor.types import DraftSource, FinishReason, Request, RequestState, SpeculativeConfig

MAX_DRAFT_TOKENS = 16
_INT32_BYTES = array(INT32).itemsize


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
        ("prompt log probs", out.prompt_log_probs is not None),
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


def pack(tokens: list[int]) -> bytes:
    """Token ids as native int32 bytes, prompt_lookup's `packed`."""
    return array(INT32, tokens).tobytes()


def prompt_lookup(tokens: list[int], packed: bytes | bytearray, k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest
    suffix n-gram (max_ngram down to min_ngram) of `tokens`; `packed`: the same
    tokens as pack() gives them. Each n-gram is one bytes.rfind, a C search, rather
    than numpy calls per token of the n-gram: the host's time per verification step
    adds to it."""
    length = len(tokens)
    if k <= 0 or length < min_ngram + 1:
        return []
    width = _INT32_BYTES
    # An earlier occurrence ends before the last token.
    limit = (length - 1) * width
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = packed[(length - n) * width : length * width]
        at = packed.rfind(suffix, 0, limit)
        while at > 0 and at % width:  # a match across token boundaries: look further back
            at = packed.rfind(suffix, 0, at + len(suffix) - 1)
        if at >= 0:
            start = at // width + n
            return tokens[start : start + k]
    return []


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


class Speculation:
    """Proposes drafts before each schedule and keeps what a verification accepts;
    counts both for the iteration stats."""

    def __init__(self, draft: DraftModel | None, blocks: BlockManager, max_seq_len: int) -> None:
        self.draft = draft
        self.blocks = blocks
        self.max_seq_len = max_seq_len
        self.num_drafted = 0  # draft tokens verified since the last take_counts()
        self.num_accepted = 0

    def propose(self, running: list[Sequence]) -> None:
        """Draft tokens (seq.draft) for the running sequences that speculate. Drafts
        follow the latest token: the step that sampled it has completed (the
        launcher's wait rule)."""
        if self.draft is not None:
            self.draft.retain(running)
        by_model = []
        for seq in running:
            if seq.spec is None:
                continue
            seq.draft = []
            if seq.in_prefill or seq.is_finished:
                continue
            k = max_drafts(seq, self.max_seq_len)
            if k <= 0:
                continue
            cfg = seq.spec.config
            if cfg.source is DraftSource.PROMPT_LOOKUP:
                seq.draft = prompt_lookup(seq.token_ids, seq.spec.packed_tokens(seq.token_ids), k, cfg.max_ngram,
                                          cfg.min_ngram)
            elif cfg.source is DraftSource.DRAFT_TOKENS:
                seq.draft = external_drafts(seq.spec, seq.generated, k)
            else:
                by_model.append((seq, k))
        if by_model:
            assert self.draft is not None
            for (seq, _), drafts in zip(by_model, self.draft.propose(by_model), strict=True):
                seq.draft = drafts

    def accept(self, seq: Sequence, drafts: list[int], tokens: list[int], log_probs: list[float],
               top: tuple[np.ndarray, np.ndarray] | None) -> None:
        """Keep the verified tokens of one speculating sequence: the drafts the target
        sampled itself, then its own next token; roll the KV of the rejected drafts
        back; end the sequence where a token ends it."""
        assert seq.spec is not None
        accepted = num_accepted(drafts, tokens)
        seq.spec.num_drafted += len(drafts)
        seq.spec.num_accepted += accepted
        self.num_drafted += len(drafts)
        self.num_accepted += accepted
        # The KV holds the last token and every draft; only the accepted drafts' stays.
        seq.num_computed -= len(drafts) - accepted
        seq.state = RequestState.GENERATION
        top_n = seq.request.output_config.top_n_log_probs
        for j in range(accepted + 1):
            seq.token_ids.append(tokens[j])
            seq.log_probs.append(log_probs[j])
            if top_n:
                assert top is not None
                seq.top_token_ids.append(top[0][j, :top_n].tolist())
                seq.top_log_probs.append(top[1][j, :top_n].tolist())
            reason = finish_reason(seq, seq.num_tokens, self.max_seq_len)
            if reason is not FinishReason.NOT_FINISHED:
                seq.finish(reason)  # tokens after this one are dropped
                break
        if not seq.is_finished:
            # Blocks wholly past the sequence held only rejected drafts' KV.
            self.blocks.truncate(seq.blocks, seq.num_tokens)

    def take_counts(self) -> tuple[int, int]:
        """(drafted, accepted) since the last call."""
        counts = (self.num_drafted, self.num_accepted)
        self.num_drafted = self.num_accepted = 0
        return counts
