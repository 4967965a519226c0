"""The runtime's descriptions of a model and of where it runs (TensorRT-LLM's
runtime `ModelConfig` / `GptModelConfig` and `WorldConfig`, snake_case)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from worker.executor import ExecutorConfig, KvCacheConfig
from worker.models.config import ModelConfig as CheckpointConfig


@dataclass(frozen=True, slots=True)
class WorldConfig:
    """The ranks that run one model together (MPI's world). Every rank builds its
    own session with its own WorldConfig. One rank until multi-GPU execution
    lands: a larger world is refused where a session is made."""

    world_size: int = 1
    rank: int = 0
    gpus_per_node: int = 8
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside the world of {self.world_size} ranks")
        if self.tp_size * self.pp_size != self.world_size:
            raise ValueError(f"tp_size {self.tp_size} x pp_size {self.pp_size} != world_size {self.world_size}")

    @property
    def device(self) -> int:
        """This rank's GPU on its node."""
        return self.rank % self.gpus_per_node

    @property
    def is_first_pipeline_rank(self) -> bool:
        return self.rank < self.tp_size

    def check_single_rank(self) -> None:
        if self.world_size != 1:
            raise NotImplementedError(
                f"a world of {self.world_size} ranks: tokenwire runs a model on one rank (world_size=1) for now")


# The Python runtime's name for the same thing.
Mapping = WorldConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """What a session needs to know about the model it runs, and the limits it is
    set up for (the Python runtime's ModelConfig; the C++ runtime's GptModelConfig)."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    hidden_size: int
    head_size: int
    max_seq_len: int
    max_batch_size: int = 8
    max_beam_width: int = 1
    dtype: str | None = None  # compute dtype; None: the backend's default (float32 on CPU, bfloat16 on CUDA)
    backend: str = "auto"  # ExecutorConfig.backend
    # Kept for TensorRT-LLM's users; these hold for every tokenwire model: paged
    # attention ("the GPT attention plugin") with in-flight batching, packed input.
    use_gpt_attention_plugin: bool = True
    use_inflight_batching_gpt_attention_plugin: bool = True
    input_packed: bool = True  # remove_input_padding
    kv_cache_max_tokens: int | None = None  # None: a fraction of free memory (KvCacheConfig)
    tokens_per_block: int = 32

    @property
    def use_multi_query_mode(self) -> bool:
        return self.num_kv_heads == 1

    @property
    def remove_input_padding(self) -> bool:
        return self.input_packed

    @classmethod
    def from_checkpoint_config(cls, cfg: CheckpointConfig, **limits: object) -> ModelConfig:
        """From the loader's description of a checkpoint; `limits`: the other fields."""
        return cls(vocab_size=cfg.vocab_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                   num_kv_heads=cfg.num_kv_heads, hidden_size=cfg.hidden_size, head_size=cfg.head_dim,
                   max_seq_len=cfg.max_position_embeddings, **limits)  # type: ignore[arg-type]

    @classmethod
    def from_dir(cls, path: str | Path, **limits: object) -> ModelConfig:
        """Read a checkpoint directory's config.json (or a .gguf file's metadata)."""
        path = Path(path)
        if path.is_dir():
            cfg = CheckpointConfig.from_hf(json.loads((path / "config.json").read_text()))
        else:
            from worker.models.loader import load_model

            cfg = load_model(path, load_weights=False).config
        return cls.from_checkpoint_config(cfg, **limits)

    def executor_config(self, world: WorldConfig | None = None) -> ExecutorConfig:
        """The executor a session runs on, sized for these limits (one rank: the backend picks the device)."""
        world = world or WorldConfig()
        world.check_single_rank()
        kv = KvCacheConfig(tokens_per_block=self.tokens_per_block, max_tokens=self.kv_cache_max_tokens)
        return ExecutorConfig(max_batch_size=self.max_batch_size, max_beam_width=self.max_beam_width,
                              kv_cache_config=kv, backend=self.backend, dtype=self.dtype)
