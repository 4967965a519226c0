"""ModelRunner: the Python runtime's one-call API over a GenerationSession.

    runner = ModelRunner.from_dir("checkpoint/")
    out = runner.generate([[1, 2, 3]], max_new_tokens=16, end_id=2, pad_id=2, return_dict=True)
    out["output_ids"]        # [batch, beam, longest prompt + max_new_tokens], pad_id padded
    out["sequence_lengths"]  # [batch, beam]
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from worker.executor import EngineCore, ExecutorConfig
from worker.runtime.config import ModelConfig, WorldConfig
from worker.runtime.generation import GenerationSession, LogitsProcessor, StoppingCriteria, split_batch
from worker.runtime.sampling import SamplingConfig


class ModelRunner:
    def __init__(self, session: GenerationSession, max_batch_size: int, max_input_len: int) -> None:
        self.session = session
        self.max_batch_size = max_batch_size
        self.max_input_len = max_input_len

    @classmethod
    def from_dir(cls, engine_dir: str | Path, *, rank: int = 0, max_batch_size: int = 8, max_beam_width: int = 1,
                 max_input_len: int | None = None, executor_config: ExecutorConfig | None = None,
                 **model_options: Any) -> ModelRunner:  # fmt: skip
        """A runner over a checkpoint directory or .gguf file (tokenwire's engine).
        `model_options`: more runtime ModelConfig fields (backend, dtype, ...);
        `executor_config`: the executor to run on, whole, instead of the one these imply."""
        mapping = WorldConfig(world_size=1, rank=rank)
        config = ModelConfig.from_dir(engine_dir, max_batch_size=max_batch_size, max_beam_width=max_beam_width,
                                      **model_options)
        core = EngineCore.from_model(engine_dir, executor_config or config.executor_config(mapping))
        return cls.from_engine(core, config, mapping, max_input_len=max_input_len)

    @classmethod
    def from_engine(cls, engine: EngineCore, model_config: ModelConfig | None = None,
                    mapping: WorldConfig | None = None, *,
                    max_input_len: int | None = None) -> ModelRunner:  # fmt: skip
        """A runner over a loaded EngineCore."""
        if model_config is None:
            exe = engine.config
            model_config = ModelConfig.from_checkpoint_config(engine.model_config, max_batch_size=exe.max_batch_size,
                                                              max_beam_width=exe.max_beam_width)
        session = GenerationSession(model_config, engine, mapping)
        return cls(session, model_config.max_batch_size, max_input_len or model_config.max_seq_len - 1)

    # -- what the model is ----------------------------------------------------------------

    @property
    def model_config(self) -> ModelConfig:
        return self.session.model_config

    @property
    def mapping(self) -> WorldConfig:
        return self.session.mapping

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def vocab_size_padded(self) -> int:
        return self.model_config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.model_config.hidden_size

    @property
    def num_heads(self) -> int:
        return self.model_config.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.model_config.num_kv_heads

    @property
    def num_layers(self) -> int:
        return self.model_config.num_layers

    @property
    def max_sequence_length(self) -> int:
        return self.model_config.max_seq_len

    @property
    def max_beam_width(self) -> int:
        return self.model_config.max_beam_width

    @property
    def remove_input_padding(self) -> bool:
        return self.model_config.remove_input_padding

    @property
    def dtype(self) -> str | None:
        return self.model_config.dtype

    @property
    def end_id(self) -> int:
        """The model's end-of-sequence token (the default end_id and pad_id)."""
        eos = self.session.core.model_config.eos_token_ids
        return eos[0] if eos else -1

    # -- generation ------------------------------------------------------------------------

    def generate(self, batch_input_ids: Any, sampling_config: SamplingConfig | None = None, *,
                 streaming: bool = False, stopping_criteria: StoppingCriteria | None = None,
                 logits_processor: LogitsProcessor | None = None, embedding_bias: Any = None,
                 **options: Any) -> Any:  # fmt: skip
        """Generate for a batch of prompts (token lists or 1-D tensors). `options`:
        SamplingConfig fields over `sampling_config` (end_id and pad_id default to the
        model's end-of-sequence token). Returns what GenerationSession.decode does:
        output_ids [batch, beam, longest prompt + max_new_tokens] padded with pad_id,
        a dict with sequence_lengths too when return_dict is set, or with `streaming`
        a generator of the same after each step."""
        prompts = split_batch(batch_input_ids)
        # A copy: the caller's config is left as it was.
        cfg = replace(sampling_config or SamplingConfig()).update(**options)
        if len(prompts) > self.max_batch_size:
            raise ValueError(f"{len(prompts)} prompts; this runner takes at most {self.max_batch_size}")
        longest = max(map(len, prompts), default=0)
        if longest > self.max_input_len:
            raise ValueError(f"a prompt of {longest} tokens; this runner takes at most {self.max_input_len}")
        self.session.setup(len(prompts), longest, cfg.max_new_tokens, cfg.beam_width)
        return self.session.decode(prompts, None, cfg, embedding_bias=embedding_bias, streaming=streaming,
                                   stopping_criteria=stopping_criteria, logits_processor=logits_processor)
