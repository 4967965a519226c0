"""Speculative decoding on every family: the verification step runs the same decoder
(q/k norms, soft-caps, sliding windows shorter than the prompts, per-layer rotary
tables) over several tokens a sequence, so a run whose drafts are all accepted, one
whose drafts are often wrong, and prompt lookup all give the tokens plain greedy
decoding gives, on the numpy backend through the in-process LLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from clients.llm import LLM
from clients.params import Speculation
from tests.checkpoints import FAMILY_CHECKPOINTS, VOCAB_SIZE
from worker.executor import ExecutorConfig, KvCacheConfig

# Each repeats itself, so prompt lookup finds matches; two are longer than the windows (6).
PROMPTS = [[5, 17, 42, 99, 3, 5, 17, 42, 99, 3], [9, 8, 7, 9, 8, 7], list(range(30, 52)) * 2]
NEW_TOKENS = 14


@pytest.mark.parametrize("name", sorted(FAMILY_CHECKPOINTS))
def test_speculation_gives_the_greedy_tokens(name: str, family_checkpoints: dict[str, Path]) -> None:
    config = ExecutorConfig(backend="numpy", max_num_tokens=32,
                            kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=2048))  # fmt: skip
    with LLM(family_checkpoints[name], config) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, max_tokens=NEW_TOKENS, temperature=0.0)]

        def run(speculation: list[Speculation]) -> tuple[list[list[int]], int, int]:
            """The tokens, and the drafted and accepted counts of the run's requests."""
            llm.executor.get_latest_request_stats()  # the earlier runs' records
            handles = [llm.generate_async(p, max_tokens=NEW_TOKENS, temperature=0.0, speculative=s)
                       for p, s in zip(PROMPTS, speculation, strict=True)]  # fmt: skip
            tokens = [h.result(60).token_ids for h in handles]
            stats = llm.executor.get_latest_request_stats()
            return tokens, sum(r.num_draft_tokens for r in stats), sum(r.num_accepted_draft_tokens for r in stats)

        right = [Speculation(source="draft_tokens", num_draft_tokens=5, draft_tokens=w) for w in want]
        # Every third drafted token wrong: verification rejects and recomputes from there.
        wrong = [Speculation(source="draft_tokens", num_draft_tokens=5,
                             draft_tokens=[(t + 1) % VOCAB_SIZE if i % 3 == 2 else t for i, t in enumerate(w)])
                 for w in want]  # fmt: skip
        lookup = [Speculation(source="prompt_lookup", num_draft_tokens=4)] * len(PROMPTS)
        tokens, drafted, accepted = run(right)
        assert tokens == want and accepted == drafted > 0
        tokens, drafted, accepted = run(wrong)
        assert tokens == want and 0 < accepted < drafted
        tokens, _, _ = run(lookup)  # drafts where the random output repeats the context, on some families none
        assert tokens == want
