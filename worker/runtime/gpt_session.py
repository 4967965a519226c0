"""GptSession: TensorRT-LLM's C++ runtime session, on a GenerationSession.

    session = GptSession(model_config, world_config, "checkpoint/")
    session.setup(batch_size, max_input_length, max_new_tokens, sampling_config)
    output = GenerationOutput(on_token_generated=lambda ids, step, finished: ...)
    session.generate(output, GenerationInput(end_id, pad_id, ids, lengths, packed), sampling_config)
    output.ids      # [batch, beam, max_input_length + max_new_tokens]: prompt, generated, pad_id
    output.lengths  # [batch, beam]
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from worker.executor import EngineCore
from worker.runtime.config import ModelConfig, WorldConfig
from worker.runtime.generation import GenerationSession, split_batch
from worker.runtime.sampling import SamplingConfig, _host


@dataclass(slots=True)
class GenerationInput:
    end_id: int
    pad_id: int
    ids: Any  # packed: [num_tokens]; padded: [batch_size, max_input_length]
    lengths: Any  # [batch_size]
    packed: bool = True
    embedding_bias: Any = None  # [vocab_size] floats added to the logits
    # TensorRT-LLM's [2, len] (every sequence) or [batch_size, 2, len] tensors; also
    # PackedWordList or lists of token lists (worker/runtime/sampling.py word_list_for).
    bad_words_list: Any = None
    stop_words_list: Any = None
    max_new_tokens: int | None = None  # None: setup's


# on_token_generated(output ids [batch, beam, max_seq_len], step, finished)
TokenCallback = Callable[[Any, int, bool], None]


@dataclass(slots=True)
class GenerationOutput:
    """Filled by GptSession.generate: given tensors of the right shape are written
    in place, otherwise new ones are set."""

    ids: Any = None  # [batch, beam, max_input_length + max_new_tokens]
    lengths: Any = None  # [batch, beam]
    log_probs: Any = None  # [max_new_tokens, batch, beam]: given (any value) to have them filled
    on_token_generated: TokenCallback | None = None


class GptSession:
    def __init__(self, model_config: ModelConfig, world_config: WorldConfig, engine: str | Path | EngineCore,
                 logger: logging.Logger | None = None) -> None:  # fmt: skip
        """`engine`: a checkpoint directory or .gguf file, or a loaded EngineCore."""
        self.logger = logger or logging.getLogger(__name__)
        self.session = GenerationSession(model_config, engine, world_config)
        self.model_config = model_config
        self.world_config = world_config
        self._max_new_tokens = 0

    def setup(self, batch_size: int, max_input_length: int, max_new_tokens: int,
              sampling_config: SamplingConfig) -> None:  # fmt: skip
        self.session.setup(batch_size, max_input_length, max_new_tokens, sampling_config.beam_width)
        self._max_new_tokens = max_new_tokens

    def generate(self, output: GenerationOutput, generation_input: GenerationInput,
                 sampling_config: SamplingConfig) -> None:  # fmt: skip
        """Run the generation loop until every sequence ends or max_new_tokens, calling
        output.on_token_generated after each step."""
        inp = generation_input
        ndim = np.ndim(_host(inp.ids))
        if ndim != (1 if inp.packed else 2):
            raise ValueError(f"GenerationInput.ids has {ndim} dimensions; packed={inp.packed} needs "
                             f"{'[num_tokens]' if inp.packed else '[batch_size, max_input_length]'}")
        cfg = replace(sampling_config, end_id=inp.end_id, pad_id=inp.pad_id,
                      max_new_tokens=inp.max_new_tokens or self._max_new_tokens,
                      stop_words_list=inp.stop_words_list, bad_words_list=inp.bad_words_list)
        prompts = split_batch(inp.ids, inp.lengths)
        state = None
        for state in self.session.generate_steps(prompts, cfg, inp.embedding_bias):
            if output.on_token_generated is not None:
                ids = self.session.outputs(state)["output_ids"]
                output.on_token_generated(ids, state.step - 1, state.all_finished)
        assert state is not None
        out = self.session.outputs(state)
        output.ids = _into(output.ids, out["output_ids"])
        output.lengths = _into(output.lengths, out["sequence_lengths"])
        if output.log_probs is not None:
            output.log_probs = _into(output.log_probs, out["log_probs"].permute(2, 0, 1))


def _into(given: Any, value: Any) -> Any:
    """`value` written into `given` when that is a tensor of its shape, else `value`."""
    if given is not None and hasattr(given, "copy_") and tuple(given.shape) == tuple(value.shape):
        given.copy_(value)
        return given
    return value
