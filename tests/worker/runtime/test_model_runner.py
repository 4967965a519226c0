"""ModelRunner and GenerationSession on tiny checkpoints, with transformers as the
oracle: greedy, beams, a stopping criterion, a logits processor; streaming."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.checkpoints import VOCAB_SIZE
from tests.worker.executor.helpers import _hf_model
from worker.runtime import (
    GenerationSession,
    KVCacheManager,
    LogitsProcessor,
    ModelConfig,
    ModelRunner,
    SamplingConfig,
    StoppingCriteria,
)

PAD = 0


@pytest.fixture(scope="module")
def runner(tiny_llama: Path) -> ModelRunner:
    return ModelRunner.from_dir(tiny_llama, backend="numpy", max_batch_size=4, max_beam_width=2,
                                kv_cache_max_tokens=4096, tokens_per_block=4)


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, VOCAB_SIZE) for _ in range(rng.randrange(3, 12))] for _ in range(n)]


def hf(checkpoint: Path, prompt: list[int], **kw: Any) -> list[list[int]]:
    """transformers' generated tokens (prompt excluded), one list per returned sequence."""
    with torch.no_grad():
        out = _hf_model(checkpoint).generate(torch.tensor([prompt]), do_sample=False, pad_token_id=PAD, **kw)
    return [row[len(prompt):] for row in out.tolist()]


def generated(out: dict[str, Any], prompt_lengths: list[int]) -> list[list[list[int]]]:
    """[batch][beam] generated tokens, from output_ids cut at sequence_lengths."""
    ids, lengths = out["output_ids"], out["sequence_lengths"]
    return [[ids[i, b, n : lengths[i, b]].tolist() for b in range(ids.shape[1])]
            for i, n in enumerate(prompt_lengths)]


def test_greedy_matches_transformers_with_padded_outputs(runner: ModelRunner, tiny_llama: Path) -> None:
    batch = prompts(1, 3)
    out = runner.generate(batch, max_new_tokens=8, end_id=-1, pad_id=PAD, return_dict=True)
    longest = max(map(len, batch))
    assert out["output_ids"].shape == (3, 1, longest + 8)
    for i, p in enumerate(batch):
        assert out["output_ids"][i, 0, : len(p)].tolist() == p  # the prompt comes first
        assert out["sequence_lengths"][i, 0] == len(p) + 8
        assert (out["output_ids"][i, 0, len(p) + 8 :] == PAD).all()  # then pad_id
        assert generated(out, [len(q) for q in batch])[i][0] == hf(tiny_llama, p, max_new_tokens=8)[0]


def test_pad_id_pads_sequences_that_end_early(runner: ModelRunner) -> None:
    p = prompts(2, 1)[0]
    free = runner.generate([p], max_new_tokens=6, end_id=-1, return_dict=True)
    eos = free["output_ids"][0, 0, len(p) + 1].item()  # ends at its 2nd generated token
    out = runner.generate([p], max_new_tokens=6, end_id=eos, pad_id=77, return_dict=True)
    stop = len(p) + free["output_ids"][0, 0, len(p):].tolist().index(eos) + 1
    assert out["sequence_lengths"][0, 0] == stop
    assert out["output_ids"][0, 0, stop:].tolist() == [77] * (len(p) + 6 - stop)


def test_beam_search_matches_transformers(runner: ModelRunner, tiny_llama: Path) -> None:
    p = prompts(3, 1)[0]
    eos = hf(tiny_llama, p, max_new_tokens=6)[0][3]
    want = hf(tiny_llama, p, max_new_tokens=10, num_beams=2, num_return_sequences=2, length_penalty=1.0,
              early_stopping=True, eos_token_id=eos)
    want = [row[: row.index(eos) + 1] if eos in row else row for row in want]
    out = runner.generate([p], max_new_tokens=10, num_beams=2, length_penalty=1.0, early_stopping=1, end_id=eos,
                          pad_id=PAD, return_dict=True)
    assert out["output_ids"].shape[:2] == (1, 2)
    assert generated(out, [len(p)])[0] == want


class EndAt(StoppingCriteria):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, step: int, input_ids: Any, scores: Any) -> Any:
        return input_ids[:, -1] == self.token  # one verdict per sequence


class Ban(LogitsProcessor):
    def __init__(self, token: int) -> None:
        self.token = token
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, step: int, input_ids: Any, scores: Any) -> Any:
        self.shapes.append(tuple(scores.shape))
        scores[:, self.token] = float("-inf")
        return scores


def test_a_stopping_criterion_ends_its_sequence_where_transformers_does(runner: ModelRunner,
                                                                         tiny_llama: Path) -> None:
    import transformers

    batch = sorted(prompts(4, 2), key=len)  # the row that stops is the shorter one: left padding matters
    assert len(batch[0]) < len(batch[1])
    free = [hf(tiny_llama, p, max_new_tokens=8)[0] for p in batch]
    token = free[0][2]

    class HfEndAt(transformers.StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
            return input_ids[:, -1] == token

    want = hf(tiny_llama, batch[0], max_new_tokens=8, stopping_criteria=transformers.StoppingCriteriaList([HfEndAt()]))
    out = runner.generate(batch, max_new_tokens=8, end_id=-1, stopping_criteria=EndAt(token), return_dict=True)
    got = generated(out, [len(p) for p in batch])
    assert got[0][0] == want[0] == free[0][: free[0].index(token) + 1]
    # The other sequence runs on unless it meets the token too.
    assert got[1][0] == (free[1][: free[1].index(token) + 1] if token in free[1] else free[1])


def test_a_logits_processor_that_bans_a_token_matches_transformers(runner: ModelRunner, tiny_llama: Path) -> None:
    batch = prompts(5, 2)
    token = hf(tiny_llama, batch[0], max_new_tokens=6)[0][1]
    want = [hf(tiny_llama, p, max_new_tokens=6, bad_words_ids=[[token]])[0] for p in batch]
    ban = Ban(token)
    out = runner.generate(batch, max_new_tokens=6, end_id=-1, logits_processor=ban, return_dict=True)
    got = generated(out, [len(p) for p in batch])
    assert [g[0] for g in got] == want and all(token not in g[0] for g in got)
    assert ban.shapes == [(2, VOCAB_SIZE)] * 6  # once per step, the whole batch


def test_decode_stream_ends_with_decodes_ids(runner: ModelRunner, tiny_llama: Path) -> None:
    session = runner.session
    batch = prompts(6, 3)
    lengths = torch.tensor([len(p) for p in batch])
    padded = torch.full((3, int(lengths.max())), PAD)
    for i, p in enumerate(batch):
        padded[i, : len(p)] = torch.tensor(p)
    cfg = SamplingConfig(end_id=-1, pad_id=PAD, max_new_tokens=5, temperature=0.9, random_seed=[1, 2, 3])
    session.setup(batch_size=3, max_context_length=int(lengths.max()), max_new_tokens=5)
    whole = session.decode(padded, lengths, cfg)
    steps = list(session.decode(padded, lengths, cfg, streaming=True))
    assert len(steps) == 5
    assert torch.equal(steps[-1], whole)
    packed = torch.cat([torch.tensor(p) for p in batch])  # the packed input form gives the same
    assert torch.equal(session.decode(packed, lengths, cfg), whole)


def test_session_model_config_and_kv_cache_manager(tiny_llama: Path) -> None:
    config = ModelConfig.from_dir(tiny_llama, backend="numpy", max_batch_size=2, kv_cache_max_tokens=1024)
    session = GenerationSession(config, tiny_llama)
    assert (session.vocab_size, session.num_layers, session.num_heads, session.hidden_size) == (VOCAB_SIZE, 2, 4, 64)
    assert isinstance(session.kv_cache_manager, KVCacheManager)
    assert session.kv_cache_manager.num_blocks * session.kv_cache_manager.block_size == 1024
    with pytest.raises(ValueError, match="max_batch_size=2"):
        session.setup(batch_size=3, max_context_length=8, max_new_tokens=4)
    with pytest.raises(RuntimeError, match="setup"):
        session.decode([[5, 6]], None, SamplingConfig())
    session.setup(batch_size=2, max_context_length=8, max_new_tokens=4)
    out = session.decode([[5, 6], [7, 8, 9]], None, SamplingConfig(max_new_tokens=4, end_id=-1),
                         output_sequence_lengths=True)
    ids, lengths = out
    assert ids.shape == (2, 1, 12) and lengths.tolist() == [[6], [7]]
    # Every block is back once the batch is done.
    assert session.kv_cache_manager.num_free == session.kv_cache_manager.num_blocks


def test_runner_properties(runner: ModelRunner) -> None:
    assert (runner.vocab_size, runner.hidden_size, runner.num_layers, runner.num_heads, runner.num_kv_heads) == (
        VOCAB_SIZE, 64, 2, 4, 2)
    assert runner.max_sequence_length == 512 and runner.max_beam_width == 2 and runner.remove_input_padding
    assert runner.mapping.world_size == 1 and runner.mapping.rank == 0


def test_session_run_gives_each_prompts_logits_as_transformers(tiny_llama: Path) -> None:
    from worker.executor import ExecutorConfig, KvCacheConfig
    from worker.runtime import Session

    session = Session.from_serialized_engine(
        tiny_llama, ExecutorConfig(backend="numpy", kv_cache_config=KvCacheConfig(max_tokens=1024)))
    batch = prompts(7, 2)
    outputs: dict[str, Any] = {}
    assert session.run({"input_ids": batch}, outputs, stream=None)
    with torch.no_grad():
        for i, p in enumerate(batch):
            want = _hf_model(tiny_llama)(torch.tensor([p])).logits[0].numpy()
            assert np.allclose(outputs["context_logits"][i], want, atol=1e-4)
            assert np.allclose(outputs["logits"][i], want[-1], atol=1e-4)
