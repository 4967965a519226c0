"""Which slice of each weight a rank holds: the model's limits, the padded vocabulary
ranges, a fused projection sharded like its parts, and a LoRA adapter's slices, whose
deltas are the rank's slice of the whole delta (summing to it on o and down)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from worker.executor import ParallelConfig
from worker.models.config import ModelConfig
from worker.models.lora import ROLES, LoraAdapter, LoraWeights, role_shape
from worker.parallel import layout

CONFIG = ModelConfig(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=2, rms_norm_eps=1e-5, rope_theta=1e4,
                     max_position_embeddings=64, tie_word_embeddings=False, attention_bias=True)  # fmt: skip


@pytest.mark.parametrize(
    ("parallel", "config", "message"),
    [
        (ParallelConfig(3), CONFIG, "4 attention heads"),
        (ParallelConfig(4), replace(CONFIG, num_kv_heads=3, num_heads=12), "3 KV heads"),
        (ParallelConfig(4), replace(CONFIG, intermediate_size=10), "intermediate size 10"),
        (ParallelConfig(1, 3), CONFIG, "2 layers do not split over 3 pipeline stages"),
        (ParallelConfig(1, 2, -1), CONFIG, "micro_batches must be >= 0"),
    ],
)
def test_a_model_that_does_not_split_is_refused(parallel: ParallelConfig, config: ModelConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layout.validate(parallel, config)


@pytest.mark.parametrize(("layers", "pp", "want"), [(2, 2, [1, 1]), (5, 2, [3, 2]), (10, 4, [3, 3, 2, 2]),
                                                    (3, 3, [1, 1, 1])])  # fmt: skip
def test_stages_hold_contiguous_runs_of_layers_the_first_ones_longer(layers: int, pp: int, want: list[int]) -> None:
    stages = [layout.stage_layers(layers, pp, s) for s in range(pp)]
    assert [len(r) for r in stages] == want
    assert [i for r in stages for i in r] == list(range(layers))
    assert layout.stage_config(CONFIG, range(1, 2)).num_layers == 1
    assert layout.stage_config(CONFIG, range(2)) is CONFIG


def test_vocabulary_ranges_are_equal_and_the_last_is_zero_padded() -> None:
    table = np.arange(10 * 2, dtype=np.float32).reshape(10, 2)
    shards = [layout.shard_vocab(table, rank, 4) for rank in range(4)]
    assert [s.shape for s in shards] == [(3, 2)] * 4
    np.testing.assert_array_equal(np.concatenate(shards)[:10], table)
    assert not np.concatenate(shards)[10:].any()


@pytest.mark.parametrize("tp", [2, 4])
def test_a_fused_qkv_shards_like_its_parts_and_kv_heads_are_copied_past_their_count(tp: int) -> None:
    rng = np.random.default_rng(0)
    d, heads, kv = CONFIG.head_dim, CONFIG.num_heads, CONFIG.num_kv_heads
    q, k, v = (rng.standard_normal((n * d, 8)).astype(np.float32) for n in (heads, kv, kv))
    bias = [rng.standard_normal((t.shape[0],)).astype(np.float32) for t in (q, k, v)]
    for rank in range(tp):
        parts, parts_bias = layout.shard_linear([q, k, v], bias, "qkv", CONFIG, rank, tp)
        fused, fused_bias = layout.shard_linear([np.concatenate([q, k, v])], [np.concatenate(bias)], "qkv",
                                                CONFIG, rank, tp)  # fmt: skip
        for a, b in zip([*parts, *(parts_bias or [])], [*fused, *(fused_bias or [])], strict=True):
            np.testing.assert_array_equal(a, b)
        head = rank * kv // tp  # the KV head this rank's query heads read
        np.testing.assert_array_equal(parts[0], q[rank * heads // tp * d : (rank + 1) * heads // tp * d])
        np.testing.assert_array_equal(parts[1][:d], k[head * d : (head + 1) * d])
        assert parts[1].shape[0] == max(1, kv // tp) * d


def test_row_parallel_projections_keep_their_input_columns() -> None:
    down = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    shards = [layout.shard_linear([down], None, "down", CONFIG, rank, 2)[0][0] for rank in range(2)]
    np.testing.assert_array_equal(np.concatenate(shards, axis=1), down)
    assert all(s.flags.c_contiguous for s in shards)


def _random_adapter(config: ModelConfig, rank: int, seed: int) -> LoraAdapter:
    rng = np.random.default_rng(seed)
    weights = {}
    for layer in range(config.num_layers):
        for role in ROLES:
            width, outs = role_shape(config, role)
            weights[layer, role] = LoraWeights(rng.standard_normal((len(outs), rank, width)).astype(np.float32),
                                               rng.standard_normal((sum(outs), len(outs), rank)).astype(np.float32))
    return LoraAdapter("random", rank, weights)


def _delta(w: LoraWeights) -> np.ndarray:
    """The adapter's whole weight delta [out, in]: B A over the parts' stacked ranks."""
    parts, rank, width = w.a.shape
    return w.b.reshape(-1, parts * rank) @ w.a.reshape(parts * rank, width)


@pytest.mark.parametrize("tp", [2, 4])  # 4: more ranks than KV heads
def test_a_lora_shard_is_the_ranks_slice_of_the_whole_delta_and_row_parallel_partials_sum_to_it(tp: int) -> None:
    adapter = _random_adapter(CONFIG, 3, seed=tp)
    shards = [layout.shard_lora(adapter, CONFIG, rank, tp) for rank in range(tp)]
    local = layout.local_config(CONFIG, tp)
    x = np.random.default_rng(1).standard_normal((5, CONFIG.intermediate_size))  # the widest input
    for (layer, role), w in adapter.weights.items():
        whole = _delta(w)
        width, outs = role_shape(local, role)
        partials = []
        for rank, shard in enumerate(shards):
            s = shard.weights[layer, role]
            assert s.a.shape == (len(outs), 3, width) and s.b.shape == (sum(outs), len(outs), 3)  # the slots' shapes
            want = np.concatenate(layout.shard_linear([whole], None, role, CONFIG, rank, tp)[0], axis=1 if
                                  role in layout.ROW_PARALLEL else 0)  # fmt: skip
            np.testing.assert_allclose(_delta(s), want, rtol=1e-6, atol=1e-5)
            if role in layout.ROW_PARALLEL:  # the rank's input columns
                partials.append(x[:, rank * width : (rank + 1) * width] @ _delta(s).T)
        if partials:
            np.testing.assert_allclose(sum(partials), x[:, : whole.shape[1]] @ whole.T, rtol=1e-5, atol=1e-4)


def test_a_stage_keeps_its_layers_adapter_weights_counted_from_its_first() -> None:
    adapter = _random_adapter(replace(CONFIG, num_layers=3), 2, seed=0)
    stage = layout.stage_lora(adapter, range(2, 3))
    assert set(stage.weights) == {(0, role) for role in ROLES}
    assert stage.weights[0, "o"] is adapter.weights[2, "o"]


def test_packed_mxfp4_experts_shard_as_their_float_values_and_stay_packed() -> None:
    """gate / up rows and down columns of MXFP4 experts cut in whole blocks: each rank's
    packed slice dequantizes to the slice of the dequantized experts; down's bias is the
    first rank's, gate's and up's biases are cut with their rows."""
    from worker.models.moe_checkpoint import ExpertTensors
    from worker.models.mxfp4 import Mxfp4Tensor

    rng = np.random.default_rng(0)
    experts, inter, hidden, tp = 3, 64, 64, 2

    def packed(out: int, cols: int) -> Mxfp4Tensor:
        blocks = rng.integers(0, 256, (experts, out, cols // 32, 16), dtype=np.uint8)
        return Mxfp4Tensor(blocks, rng.integers(120, 130, (experts, out, cols // 32), dtype=np.uint8))

    gate_bias, up_bias = rng.standard_normal((experts, inter)), rng.standard_normal((experts, inter))
    down_bias = rng.standard_normal((experts, hidden))
    whole = ExpertTensors(router=np.zeros((experts, hidden)), router_bias=None, gate=packed(inter, hidden),
                          up=packed(inter, hidden), down=packed(hidden, inter), gate_bias=gate_bias, up_bias=up_bias,
                          down_bias=down_bias)  # fmt: skip
    for rank in range(tp):
        part = layout.shard_experts(whole, rank, tp)
        rows = slice(rank * inter // tp, (rank + 1) * inter // tp)
        assert isinstance(part.gate, Mxfp4Tensor) and isinstance(part.up, Mxfp4Tensor)
        assert isinstance(part.down, Mxfp4Tensor)
        for e in range(experts):
            np.testing.assert_array_equal(part.gate[e], whole.gate[e][rows])
            np.testing.assert_array_equal(part.up[e], whole.up[e][rows])
            np.testing.assert_array_equal(part.down[e], whole.down[e][:, rows])
        np.testing.assert_array_equal(part.gate_bias, gate_bias[:, rows])
        np.testing.assert_array_equal(part.up_bias, up_bias[:, rows])
        np.testing.assert_array_equal(part.down_bias, down_bias if rank == 0 else 0 * down_bias)
