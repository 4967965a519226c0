"""TensorRT-LLM's C++ GPT runtime under tokenwire's names: GptSession,
GenerationInput / GenerationOutput, WorldConfig, the runtime SamplingConfig's
per-sequence vectors, the [2, len] word lists, in its documents' order and names
(snake_case)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from worker.executor import PackedWordList
from worker.runtime import (
    GenerationInput,
    GenerationOutput,
    GptModelConfig,
    GptSession,
    SamplingConfig,
    WorldConfig,
)

END_ID = 2
PAD_ID = 0


@pytest.fixture(scope="module")
def session(model_dir: Path) -> GptSession:
    # GptSession session(modelConfig, worldConfig, engineBuffer, engineSize, logger);
    model_config = GptModelConfig.from_dir(model_dir, backend="numpy", max_batch_size=4, kv_cache_max_tokens=4096)
    world_config = WorldConfig(world_size=1, rank=0)
    return GptSession(model_config, world_config, model_dir)


PROMPTS = [[10, 11, 12, 13, 14], [20, 21, 22], [30, 31, 32, 33]]


def padded_input(end_id: int = END_ID, **kw: Any) -> GenerationInput:
    lengths = torch.tensor([len(p) for p in PROMPTS], dtype=torch.int32)
    ids = torch.full((len(PROMPTS), int(lengths.max())), PAD_ID, dtype=torch.int32)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p)] = torch.tensor(p)
    return GenerationInput(end_id, PAD_ID, ids, lengths, False, **kw)


def packed_input(end_id: int = END_ID, **kw: Any) -> GenerationInput:
    ids = torch.tensor([t for p in PROMPTS for t in p], dtype=torch.int32)
    return GenerationInput(end_id, PAD_ID, ids, torch.tensor([len(p) for p in PROMPTS]), True, **kw)


def test_setup_then_generate_with_the_token_callback(session: GptSession) -> None:
    sampling_config = SamplingConfig(beam_width=1)
    session.setup(batch_size=3, max_input_length=5, max_new_tokens=6, sampling_config=sampling_config)
    calls: list[tuple[int, bool, tuple[int, ...]]] = []

    def on_token_generated(ids: Any, step: int, finished: bool) -> None:
        calls.append((step, finished, tuple(ids.shape)))

    output = GenerationOutput(on_token_generated=on_token_generated, log_probs=True)
    session.generate(output, padded_input(), sampling_config)
    # ids: [batchSize, beamWidth, maxSeqLength], maxSeqLength = maxInputLength + maxNewTokens
    assert output.ids.shape == (3, 1, 5 + 6) and output.lengths.shape == (3, 1)
    for i, p in enumerate(PROMPTS):
        assert output.ids[i, 0, : len(p)].tolist() == p  # a copy of the input tokens, then the output
        assert (output.ids[i, 0, output.lengths[i, 0] :] == PAD_ID).all()
    assert output.log_probs.shape == (6, 3, 1)  # [maxNewTokens, batchSize, beamWidth]
    assert [c[0] for c in calls] == list(range(len(calls))) and calls[-1][1] and not calls[0][1]
    assert all(shape == (3, 1, 11) for _, _, shape in calls)

    packed = GenerationOutput()
    session.generate(packed, packed_input(), sampling_config)  # packed input: the same outputs
    assert torch.equal(packed.ids, output.ids) and torch.equal(packed.lengths, output.lengths)


def test_preallocated_output_tensors_are_filled_in_place(session: GptSession) -> None:
    cfg = SamplingConfig()
    session.setup(3, 5, 4, cfg)
    ids = torch.empty((3, 1, 9), dtype=torch.int64)
    output = GenerationOutput(ids=ids)
    session.generate(output, packed_input(), cfg)
    assert output.ids is ids and ids[0, 0, :5].tolist() == PROMPTS[0]


def test_trtllm_word_list_layout(session: GptSession) -> None:
    # words [5, 7, 3], [9, 2], [6, 2, 4, 1]: row 0 the 9 tokens, row 1 the exclusive prefix sum
    packed = torch.tensor([[5, 7, 3, 9, 2, 6, 2, 4, 1], [0, 3, 5, 9, -1, -1, -1, -1, -1]])
    assert PackedWordList(*packed.tolist()).words() == [[5, 7, 3], [9, 2], [6, 2, 4, 1]]
    # four single-token words: the inner dimension grows by one
    singles = PackedWordList([5, 9, 6, 1, 0], [0, 1, 2, 3, 4])
    assert singles.words() == [[5], [9], [6], [1]]

    cfg = SamplingConfig(end_id=-1)
    session.setup(3, 5, 6, cfg)
    free = GenerationOutput()
    session.generate(free, packed_input(end_id=-1), cfg)
    first = [int(free.ids[i, 0, len(p)]) for i, p in enumerate(PROMPTS)]
    # ban every sequence's first token ([2, len]: the same list for the batch) ...
    banned = GenerationOutput()
    bad = torch.tensor([[*first, 0], list(range(len(first) + 1))])
    session.generate(banned, packed_input(end_id=-1, bad_words_list=bad), cfg)
    assert all(int(banned.ids[i, 0, len(p)]) != first[i] for i, p in enumerate(PROMPTS))
    # ... and stop sequence 0 at its second token ([batch, 2, len]: one list per sequence)
    second = int(free.ids[0, 0, len(PROMPTS[0]) + 1])
    stop = torch.tensor([[[second, 0], [0, 1]], [[1, 0], [0, 1]], [[1, 0], [0, 1]]])
    stopped = GenerationOutput()
    session.generate(stopped, packed_input(end_id=-1, stop_words_list=stop), cfg)
    assert stopped.lengths[0, 0] <= len(PROMPTS[0]) + 2 < free.lengths[0, 0]
    assert int(stopped.ids[0, 0, stopped.lengths[0, 0] - 1]) == second


def test_per_sequence_vectors_and_size_one_broadcast(session: GptSession) -> None:
    def run(cfg: SamplingConfig) -> torch.Tensor:
        session.setup(3, 5, 6, cfg)
        out = GenerationOutput()
        session.generate(out, packed_input(end_id=-1), cfg)
        return out.ids

    one = run(SamplingConfig(temperature=[1.0], random_seed=[7]))
    each = run(SamplingConfig(temperature=[1.0, 1.0, 1.0], random_seed=[7, 7, 7]))
    assert torch.equal(one, each)  # a size-1 vector is every sequence's value
    greedy = run(SamplingConfig())
    mixed = run(SamplingConfig(temperature=[0.0, 1.0, 0.0], random_seed=[7, 7, 7]))
    assert torch.equal(mixed[0], greedy[0]) and torch.equal(mixed[2], greedy[2])
    assert torch.equal(mixed[1], one[1])
    # top_k = 0 and top_p = 0 (the runtime's defaults): greedy search
    assert torch.equal(run(SamplingConfig(top_k=0, top_p=0.0, temperature=1.0)), greedy)
    with pytest.raises(ValueError, match="2 values for a batch of 3"):
        run(SamplingConfig(temperature=[1.0, 0.5]))


def test_the_world_is_one_rank_for_now(model_dir: Path) -> None:
    world = WorldConfig(world_size=2, rank=1, tp_size=2)
    assert world.device == 1
    with pytest.raises(NotImplementedError, match="world_size=1"):
        GptSession(GptModelConfig.from_dir(model_dir, backend="numpy"), world, model_dir)
    with pytest.raises(ValueError, match="rank 2"):
        WorldConfig(world_size=2, rank=2, tp_size=2)


def test_model_config_fields(model_dir: Path) -> None:
    cfg = GptModelConfig.from_dir(model_dir)
    assert (cfg.vocab_size, cfg.num_layers, cfg.num_heads, cfg.hidden_size) == (320, 2, 4, 64)
    assert cfg.use_gpt_attention_plugin and cfg.input_packed and not cfg.use_multi_query_mode
    assert cfg.use_inflight_batching_gpt_attention_plugin

