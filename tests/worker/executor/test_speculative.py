"""Speculative decoding in the engine core: every draft source gives the tokens
ordinary decoding gives (greedy and seeded sampling), leaves the sampling
distribution alone, ends runs where stop words, end ids and max_tokens land, and
keeps the KV cache consistent through rejections, cancels and preemption."""

from __future__ import annotations

import random
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.checkpoints import VOCAB_SIZE
from worker.executor import (
    CapacitySchedulerPolicy,
    DraftSource,
    EngineCore,
    ExecutorConfig,
    FinishReason,
    KvCacheConfig,
    OutputConfig,
    Request,
    RequestStats,
    SamplingConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StepOutput,
)
from worker.executor.speculative import SpecState, external_drafts, num_accepted, pack, prompt_lookup

Spec = Callable[[int], SpeculativeConfig | None]  # request index -> its speculative config


@pytest.fixture(scope="module")
def near_draft(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama with every weight perturbed a little: a draft model that agrees
    with the target on most tokens, not all (another random model never does)."""
    from safetensors.numpy import load_file, save_file

    out = tmp_path_factory.mktemp("near_draft")
    for f in tiny_llama.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    rng = np.random.default_rng(0)
    weights = load_file(tiny_llama / "model.safetensors")
    save_file({k: (w * (1 + 0.15 * rng.standard_normal(w.shape))).astype(w.dtype) for k, w in weights.items()},
              out / "model.safetensors", metadata={"format": "pt"})
    return out


def config(**kw: object) -> ExecutorConfig:
    base: dict[str, object] = {"backend": "numpy", "max_num_tokens": 24,
                               "kv_cache_config": KvCacheConfig(tokens_per_block=4, max_tokens=4096)}
    return ExecutorConfig(**{**base, **kw})  # type: ignore[arg-type]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves (so prompt lookup finds matches), some sharing a prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(5, VOCAB_SIZE) for _ in range(9)]
    out = []
    for i in range(n):
        body = [rng.randrange(5, VOCAB_SIZE) for _ in range(rng.randrange(2, 14))]
        out.append((shared if i % 2 else []) + body + body)
    return out


class Run:
    """One core driven to completion: tokens, finish reasons, stats and the column counts."""

    def __init__(self, core: EngineCore, requests: list[Request], check: bool = False,
                 cancel_at: dict[int, int] | None = None) -> None:
        """`check`: check the KV cache after every step; `cancel_at`: step -> request to abort then."""
        self.core = core
        self.tokens: dict[int, list[int]] = {i: [] for i in range(len(requests))}
        self.reasons: dict[int, FinishReason] = {}
        self.request_stats: dict[int, RequestStats] = {}
        self.drafted = self.accepted = 0
        self.max_streamed = 0  # most tokens one plain streamed step carried
        core.add_requests(enumerate(requests))
        for step in range(20_000):
            if not core.has_work:
                break
            if cancel_at and step in cancel_at:
                core.abort(cancel_at[step])
            self.take(core.step())
            if check:
                check_kv(core)
        else:
            raise AssertionError("the core never ran out of work")
        check_kv(core)
        assert core.blocks.num_free == core.blocks.num_blocks

    def take(self, out: StepOutput) -> None:
        self.max_streamed = max([self.max_streamed, *out.counts])
        for r in out.all_responses():
            assert r.result is not None, r.error_msg
            self.tokens[r.request_id] += r.result.output_token_ids[0]
            if r.result.is_final:
                self.reasons[r.request_id] = r.result.finish_reasons[0]
        for s in out.request_stats:
            self.request_stats[s.request_id] = s
        for it in out.iteration_stats:
            self.drafted += it.num_draft_tokens
            self.accepted += it.num_accepted_draft_tokens


def check_kv(core: EngineCore) -> None:
    """Reference counts match the tables; no sequence holds a block wholly past its
    tokens; only computed tokens are hashed (never a rejected draft's KV); the
    draft model's cache is consistent too."""
    seqs = core.scheduler.running + core.scheduler.waiting
    core.blocks.check_invariants([s.blocks for s in seqs])
    bs = core.blocks.block_size
    for s in seqs:
        assert len(s.blocks.block_ids) <= core.blocks.blocks_for(s.num_tokens), "a block past the tokens"
        assert s.blocks.num_hashed * bs <= s.num_computed, "a hashed block that is not computed"
        assert s.num_computed <= s.num_tokens
    for s in core.scheduler.waiting:
        assert not s.blocks.block_ids or s.num_pending == 0
    if core.draft is not None:
        assert core.draft.blocks is not None
        core.draft.blocks.check_invariants(core.draft.tables)


def requests(prompt_list: list[list[int]], spec: Spec, max_tokens: int = 20, **kw: object) -> list[Request]:
    return [Request(input_token_ids=p, max_tokens=max_tokens, end_id=-1, speculative_config=spec(i),
                    **kw) for i, p in enumerate(prompt_list)]  # type: ignore[arg-type]


def run(model: Path, reqs: list[Request], draft: Path | None = None, check: bool = False,
        **kw: object) -> Run:
    return Run(EngineCore.from_model(model, config(draft_model=None if draft is None else str(draft), **kw)),
               reqs, check)


# -- the pieces ------------------------------------------------------------------------------


def test_prompt_lookup_continues_the_latest_occurrence_of_the_longest_suffix() -> None:
    def lookup(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
        return prompt_lookup(tokens, pack(tokens), k, max_ngram, min_ngram)

    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert lookup(tokens, 2, 3, 1) == [7, 8]  # the latest earlier [1, 2, 3]
    assert lookup([5, 2, 3, 8, 1, 2, 3, 7, 0, 1, 2, 3], 1, 3, 1) == [7]  # [1, 2, 3] beats the later [2, 3]
    assert lookup([1, 2, 3, 8, 5, 2, 3, 7, 0, 1, 2, 3], 1, 3, 1) == [8]  # [1, 2, 3] beats the later [2, 3]
    assert lookup([4, 5, 6, 1, 2, 6], 3, 3, 1) == [1, 2, 6]  # only the 1-gram [6] matches
    assert lookup([4, 5, 6, 1, 2, 6], 3, 3, 2) == []  # ... which is below min_ngram
    assert lookup([4, 5, 4], 5, 2, 1) == [5, 4]  # runs into the end of the tokens
    assert lookup([4], 5, 3, 1) == []
    # 256 and 1 as int32 bytes overlap ([0 1 0 0][1 0 0 0]): only whole tokens match.
    assert lookup([256, 1, 0, 7, 1], 2, 1, 1) == [0, 7]
    assert lookup([256, 0, 0, 7, 1], 2, 1, 1) == []


def _reference_lookup(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The latest end e < len - 1 of the longest suffix n-gram, by brute force."""
    for n in range(max_ngram, min_ngram - 1, -1):
        suffix = tokens[len(tokens) - n :] if n <= len(tokens) else None
        for e in range(len(tokens) - 2, n - 2, -1):
            if suffix is not None and tokens[e - n + 1 : e + 1] == suffix:
                return tokens[e + 1 : e + 1 + k]
    return []


@pytest.mark.parametrize("seed", range(10))
def test_prompt_lookup_on_growing_tokens_matches_a_brute_force_search(seed: int) -> None:
    rng = random.Random(seed)
    config = SpeculativeConfig(max_ngram=rng.randint(1, 4), min_ngram=1)
    config.min_ngram = rng.randint(1, config.max_ngram)
    state = SpecState(config)
    # Few distinct ids (repeats), ids whose bytes overlap, and large ones.
    alphabet = rng.sample([0, 1, 2, 3, 256, 257, 65536, 65537, 50000, 2**31 - 1], rng.randint(2, 10))
    tokens = [rng.choice(alphabet) for _ in range(rng.randint(1, 5))]
    for _ in range(300):
        k = rng.randint(0, 8)
        got = prompt_lookup(tokens, state.packed_tokens(tokens), k, config.max_ngram, config.min_ngram)
        assert got == _reference_lookup(tokens, k, config.max_ngram, config.min_ngram), tokens
        tokens += [rng.choice(alphabet) for _ in range(rng.randint(1, 3))]


def test_the_packed_tokens_follow_the_growing_tokens() -> None:
    state = SpecState(SpeculativeConfig())
    tokens = list(range(5))
    assert bytes(state.packed_tokens(tokens)) == pack(tokens)
    for t in range(5, 40):
        tokens.append(t % 7)
        assert bytes(state.packed_tokens(tokens)) == pack(tokens)


def test_acceptance_is_the_longest_prefix_the_target_sampled_itself() -> None:
    assert num_accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert num_accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert num_accepted([5], [4, 1]) == 0


def test_external_drafts_follow_the_callers_tokens_until_the_output_leaves_them() -> None:
    state = SpecState(SpeculativeConfig(DraftSource.DRAFT_TOKENS, 2, draft_tokens=[1, 2, 3, 4, 5]))
    assert external_drafts(state, [], 2) == [1, 2]
    assert external_drafts(state, [1, 2, 3], 2) == [4, 5]
    assert external_drafts(state, [1, 2, 3, 9], 2) == []
    assert state.diverged and external_drafts(state, [1, 2, 3, 4], 2) == []


# -- greedy: token-identical with speculation on and off ----------------------------------------


def _sources(draft_model: Path) -> dict[str, tuple[Callable[[int, list[int]], SpeculativeConfig], Path | None]]:
    """name -> (k, expected output -> config, draft model)."""
    return {
        "prompt_lookup": (lambda k, _: SpeculativeConfig(DraftSource.PROMPT_LOOKUP, k), None),
        # The expected output, wrong from its 12th token on: accepted, then rejected.
        "draft_tokens": (lambda k, want: SpeculativeConfig(
            DraftSource.DRAFT_TOKENS, k, draft_tokens=[*want[:11], (want[11] + 1) % VOCAB_SIZE, *want[12:]]),
            None),
        "draft_model": (lambda k, _: SpeculativeConfig(DraftSource.DRAFT_MODEL, k), draft_model),
    }


@pytest.mark.parametrize("source", ["prompt_lookup", "draft_tokens", "draft_model"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_greedy_output_is_token_identical_with_every_draft_length(
        tiny_llama: Path, near_draft: Path, source: str, overlap: bool) -> None:
    model = tiny_llama
    make, draft = _sources(near_draft)[source]
    ps = prompts(8)
    want = run(model, requests(ps, lambda i: None), overlap_scheduling=overlap).tokens
    total_drafted = total_accepted = 0
    for k in range(1, 9):
        # Every other request speculates: the batches mix verification and plain steps.
        got = run(model, requests(ps, lambda i, k=k: make(k, want[i]) if i % 2 == 0 else None), draft,  # type: ignore[misc]
                  overlap_scheduling=overlap)
        assert got.tokens == want, f"k={k}"
        assert got.drafted > 0
        assert got.drafted == sum(s.num_draft_tokens for s in got.request_stats.values())
        assert got.accepted == sum(s.num_accepted_draft_tokens for s in got.request_stats.values())
        assert all(got.request_stats[i].num_draft_tokens == 0 for i in range(1, len(ps), 2))
        total_drafted += got.drafted
        total_accepted += got.accepted
    # The sources propose real continuations here: some accepted, and (the draft
    # model is a perturbed copy, draft_tokens go wrong) some rejected.
    assert 0 < total_accepted < total_drafted


def test_a_draft_model_identical_to_the_target_has_its_greedy_drafts_accepted(tiny_llama: Path) -> None:
    spec = SpeculativeConfig(DraftSource.DRAFT_MODEL, 4)
    ps = prompts(6)
    want = run(tiny_llama, requests(ps, lambda i: None)).tokens
    got = run(tiny_llama, requests(ps, lambda i: spec), tiny_llama)
    assert got.tokens == want
    assert got.accepted >= 0.95 * got.drafted > 0
    # Four drafts accepted and a bonus token: five tokens per step, fewer steps.
    assert got.core.completion.iter < run(tiny_llama, requests(ps, lambda i: None)).core.completion.iter


def test_the_worker_default_applies_to_requests_without_their_own(tiny_llama: Path) -> None:
    ps = prompts(4)
    want = run(tiny_llama, requests(ps, lambda i: None)).tokens
    got = run(tiny_llama, requests(ps, lambda i: None), speculative_config=SpeculativeConfig(num_draft_tokens=3))
    assert got.tokens == want and got.drafted > 0
    # A request turns speculation off for itself with num_draft_tokens=0.
    off = run(tiny_llama, requests(ps, lambda i: SpeculativeConfig(num_draft_tokens=0)),
              speculative_config=SpeculativeConfig(num_draft_tokens=3))
    assert off.tokens == want and off.drafted == 0


def test_greedy_identical_on_the_torch_cpu_backend(tiny_checkpoints: dict[str, Path]) -> None:
    pytest.importorskip("torch")
    model = tiny_checkpoints["llama_gqa"]
    ps = prompts(6)
    want = run(model, requests(ps, lambda i: None), backend="torch", device="cpu", dtype="float32").tokens
    for spec, draft in ((SpeculativeConfig(num_draft_tokens=5), None),
                        (SpeculativeConfig(DraftSource.DRAFT_MODEL, 3), tiny_checkpoints["qwen2_bias"])):
        got = run(model, requests(ps, lambda i, s=spec: s if i % 3 else None), draft,  # type: ignore[misc]
                  backend="torch", device="cpu", dtype="float32")
        assert got.tokens == want and got.drafted > 0


# -- sampling ----------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["prompt_lookup", "draft_tokens", "draft_model"])
def test_seeded_sampling_is_identical_with_speculation_on_and_off(tiny_checkpoints: dict[str, Path],
                                                                   source: str) -> None:
    model = tiny_checkpoints["llama_gqa"]
    make, draft = _sources(model)[source]  # the target as its own draft: many acceptances
    ps = prompts(8, seed=1)
    sampling = [SamplingConfig(temperature=0.7, top_k=20, seed=100 + i) for i in range(len(ps))]
    sampling[3] = SamplingConfig(temperature=1.0, top_p=0.8, min_p=0.05, seed=7)

    def reqs(spec: Spec) -> list[Request]:
        return [Request(input_token_ids=p, max_tokens=16, end_id=-1, sampling_config=sampling[i],
                        speculative_config=spec(i), output_config=OutputConfig(return_log_probs=True))
                for i, p in enumerate(ps)]

    want = run(model, reqs(lambda i: None)).tokens
    got = run(model, reqs(lambda i: make(4, want[i]) if i != 5 else None), draft)
    assert got.tokens == want
    # Random tiny models rarely repeat their prompt when sampling: lookups get rejected.
    assert got.drafted > 0 and (got.accepted > 0 or source == "prompt_lookup")


def _sampled_tokens(core: EngineCore, prompt: list[int], seeds: range,
                    spec: SpeculativeConfig | None) -> list[Counter[int]]:
    """How often each token came out at output positions 1 and 2, one request per seed."""
    reqs = [Request(input_token_ids=prompt, max_tokens=3, end_id=-1, speculative_config=spec,
                    sampling_config=SamplingConfig(temperature=1.0, top_k=4, seed=s)) for s in seeds]
    got = Run(core, reqs)
    assert spec is None or got.accepted > 0
    return [Counter(t[position] for t in got.tokens.values()) for position in (1, 2)]


def _chi_square_p_value(a: Counter[int], b: Counter[int]) -> float:
    """Pearson's chi-square test that two samples come from one distribution; tokens
    seen fewer than 10 times in both together are pooled into one cell."""
    torch = pytest.importorskip("torch")
    table, rest = [], np.zeros(2)
    for token in set(a) | set(b):
        row = np.array([a[token], b[token]], dtype=np.float64)
        if row.sum() >= 10:
            table.append(row)
        else:
            rest += row
    if rest.sum():
        table.append(rest)
    counts = np.array(table)
    assert len(counts) >= 3, "the distribution is too concentrated to test anything"
    expected = counts.sum(axis=1, keepdims=True) * counts.sum(axis=0, keepdims=True) / counts.sum()
    statistic = float(((counts - expected) ** 2 / expected).sum())
    # The chi-square survival function: the regularized upper incomplete gamma Q(dof / 2, x / 2).
    dof = torch.tensor((len(counts) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(statistic / 2, dtype=torch.float64)))


def test_speculation_leaves_the_sampling_distribution_unchanged(tiny_llama: Path) -> None:
    """Chi-square two-sample tests at significance 0.001 on the tokens at output
    positions 1 and 2 (the first decided by a verification step's first row, the
    second by a later row when a draft was accepted): 1500 requests with
    speculation and 1500 without, on disjoint seeds, so this compares
    distributions, not the fixed-seed identity. The draft model is the target
    itself, greedy: its drafts are accepted exactly when the target's sample is its
    argmax, where a wrong acceptance rule would skew the frequencies (emitting the
    draft for a quarter of the rejections gives p < 1e-30 here)."""
    prompt = prompts(1, seed=4)[0]
    n = 1500
    big = {"max_num_tokens": 2048, "max_batch_size": 256}
    on = _sampled_tokens(EngineCore.from_model(tiny_llama, config(draft_model=str(tiny_llama), **big)), prompt,
                         range(n), SpeculativeConfig(DraftSource.DRAFT_MODEL, 2))
    off = _sampled_tokens(EngineCore.from_model(tiny_llama, config(**big)), prompt, range(n, 2 * n), None)
    for position, (a, b) in enumerate(zip(on, off, strict=True), start=1):
        p_value = _chi_square_p_value(a, b)
        assert p_value > 0.001, f"position {position}: p = {p_value:.2g}"


# -- where a run ends -------------------------------------------------------------------------------


def test_stop_words_end_ids_and_max_tokens_inside_an_accepted_run(tiny_llama: Path) -> None:
    ps = prompts(3, seed=2)
    want = run(tiny_llama, requests(ps, lambda i: None, max_tokens=30)).tokens
    # All drafts right: every run is accepted whole, so each stop lands inside one.
    def spec(i: int) -> SpeculativeConfig:
        return SpeculativeConfig(DraftSource.DRAFT_TOKENS, 8, draft_tokens=want[i])

    for extra in ({"stop_words": [want[0][9:11]]}, {"end_id": want[0][13]}, {"max_tokens": 11}):
        reqs = [Request(input_token_ids=p, max_tokens=30, end_id=-1, speculative_config=spec(i), streaming=True)
                for i, p in enumerate(ps)]
        plain = [Request(input_token_ids=p, max_tokens=30, end_id=-1, streaming=True) for p in ps]
        for r in (reqs[0], plain[0]):
            for key, value in extra.items():
                setattr(r, key, value)
        off, on = run(tiny_llama, plain), run(tiny_llama, reqs)
        assert on.tokens == off.tokens and on.reasons == off.reasons, extra
        assert len(on.tokens[0]) < 30 and on.reasons[0] is not FinishReason.NOT_FINISHED
        assert on.max_streamed > 1  # several tokens in one streamed step


def test_requests_whose_sampling_reads_the_same_steps_tokens_do_not_speculate(tiny_llama: Path) -> None:
    spec = SpeculativeConfig(num_draft_tokens=4)
    ps = prompts(3)
    penalized = [Request(input_token_ids=p, max_tokens=12, end_id=-1, speculative_config=spec,
                         sampling_config=SamplingConfig(repetition_penalty=1.3)) for p in ps]
    got = run(tiny_llama, penalized)
    assert got.drafted == 0
    assert all(s.speculation_off_reason and "penalties" in s.speculation_off_reason
               for s in got.request_stats.values())
    plain = [Request(input_token_ids=p, max_tokens=12, end_id=-1,
                     sampling_config=SamplingConfig(repetition_penalty=1.3)) for p in ps]
    assert got.tokens == run(tiny_llama, plain).tokens


def test_an_invalid_speculative_config_is_refused(tiny_llama: Path) -> None:
    core = EngineCore.from_model(tiny_llama, config())
    core.add_requests([(1, Request(input_token_ids=[5, 6], max_tokens=4,
                                   speculative_config=SpeculativeConfig(num_draft_tokens=99)))])
    (r,) = core.step().responses
    assert r.error_msg is not None and "num_draft_tokens" in r.error_msg


# -- KV invariants --------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(CapacitySchedulerPolicy))
def test_kv_invariants_hold_through_rejections_cancels_and_preemption(
        tiny_llama: Path, near_draft: Path, policy: CapacitySchedulerPolicy) -> None:
    """Random speculating and plain requests on a small cache (MAX_UTILIZATION
    preempts), some cancelled at random steps; the cache is checked after every
    step, and the requests that were not cancelled give ordinary decoding's tokens."""
    model, draft = tiny_llama, near_draft
    rng = random.Random(11)
    ps = prompts(14, seed=5)
    want = run(model, requests(ps, lambda i: None, max_tokens=24)).tokens
    sources = [None, SpeculativeConfig(DraftSource.PROMPT_LOOKUP, 6), SpeculativeConfig(DraftSource.DRAFT_MODEL, 3),
               SpeculativeConfig(DraftSource.DRAFT_TOKENS, 5, draft_tokens=[rng.randrange(VOCAB_SIZE)] * 3)]
    specs = [sources[i % len(sources)] for i in range(len(ps))]
    cfg = config(draft_model=str(draft), max_batch_size=8,
                 kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=4 * 40),
                 scheduler_config=SchedulerConfig(capacity_scheduler_policy=policy))
    cancelled = rng.sample(range(len(ps)), 4)
    cancel_at = dict(zip(rng.sample(range(2, 40), 4), cancelled, strict=True))
    got = Run(EngineCore.from_model(model, cfg), requests(ps, lambda i: specs[i], max_tokens=24), True, cancel_at)
    core = got.core
    assert core.draft is not None and core.draft.blocks is not None
    core.draft.retain([])
    assert core.draft.blocks.num_free == core.draft.blocks.num_blocks
    for i in range(len(ps)):
        if got.reasons[i] is FinishReason.CANCELLED:
            assert i in cancelled
            assert got.tokens[i] == want[i][: len(got.tokens[i])]
        else:
            assert got.tokens[i] == want[i], i
    assert got.accepted < got.drafted
    if policy is CapacitySchedulerPolicy.MAX_UTILIZATION:
        assert core.scheduler.num_preemptions > 0


# -- the default model ----------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_greedy_identical_with_prompt_lookup_and_a_draft_model(default_gguf: Path) -> None:
    """The real model, each prompt with and without speculation in one batch: a
    code-repeating prompt with prompt lookup, another with a draft model made of the
    model's first 8 of 30 layers (mechanics, not speed); then the caller's draft tokens."""
    from worker.backends.device import create_backend
    from worker.executor.draft_model import DraftModel, first_layers
    from worker.models.loader import load_model

    loaded = load_model(default_gguf)
    cfg = config(max_num_tokens=256, kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=2048))
    draft = DraftModel.from_loaded(first_layers(loaded, 8), "numpy", None, None, 256, 8)
    core = EngineCore(create_backend(loaded, "numpy"), cfg, draft=draft)
    code = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
    texts = [f"Repeat this code exactly:\n{code}\nAnswer:\n", "The capital of France is"]
    ps = [loaded.tokenizer.encode(t).ids for t in texts]
    specs = [SpeculativeConfig(num_draft_tokens=6), SpeculativeConfig(DraftSource.DRAFT_MODEL, 3)]
    reqs = [Request(input_token_ids=p, max_tokens=16, end_id=-1, speculative_config=spec)
            for p, s in zip(ps, specs, strict=True) for spec in (s, None)]
    got = Run(core, reqs)
    assert got.tokens[0] == got.tokens[1] and got.tokens[2] == got.tokens[3]
    lookup, model = got.request_stats[0], got.request_stats[2]
    assert lookup.num_accepted_draft_tokens > 0 and model.num_draft_tokens > 0
    # The caller's draft tokens: the output itself, wrong at one token.
    want = got.tokens[1]
    wrong = [*want[:7], (want[7] + 1) % loaded.config.vocab_size, *want[8:]]
    external = Run(core, [Request(input_token_ids=ps[0], max_tokens=16, end_id=-1, speculative_config=SpeculativeConfig(
        DraftSource.DRAFT_TOKENS, 8, draft_tokens=wrong))])
    assert external.tokens[0] == want and 0 < external.accepted < external.drafted
