"""GenerationSession: a static batch generated to the end on one EngineCore (the
Python runtime's session), with the user's StoppingCriteria and LogitsProcessor
called once per generation step.

The session drives the core itself (no thread): it adds the batch's requests,
steps until every one is final and assembles TensorRT-LLM's padded outputs,
`output_ids` [batch, beam, max_context_length + max_new_tokens] (each row the
prompt, then the generated tokens, then pad_id) and `sequence_lengths`
[batch, beam]. A logits processor or a stopping criterion runs through the
core's batched logits post-processor, which brings each step's logits to the
host; without them the core keeps its device-side fast path.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from worker.executor import EngineCore, OutputConfig, Request, Response
from worker.executor.block_manager import BlockManager
from worker.executor.logits_processors import BATCHED
from worker.runtime.config import ModelConfig, WorldConfig
from worker.runtime.sampling import SamplingConfig, _host


class LogitsProcessor:
    """Subclass and implement `__call__`: once per generation step, with the step
    number, the batch's tokens so far (`input_ids` [batch * beam, length], prompt
    included, left-padded with pad_id: column -1 is each row's latest token) and
    the step's logits (`scores` [batch * beam, vocab]), as CPU torch tensors.
    Return the logits to sample from (changing `scores` in place and returning it
    is fine). Rows of sequences not sampling in this step (finished ones) hold
    zeros and are ignored."""

    def __call__(self, step: int, input_ids: Any, scores: Any) -> Any:
        raise NotImplementedError


class LogitsProcessorList(list[LogitsProcessor], LogitsProcessor):
    """Several processors, applied in order."""

    def __call__(self, step: int, input_ids: Any, scores: Any) -> Any:
        for processor in self:
            scores = processor(step, input_ids, scores)
        return scores


class StoppingCriteria:
    """Subclass and implement `__call__`: after each generation step, with the step
    number, the batch's tokens (new ones included) and the step's logits (as a
    LogitsProcessor sees them). Return True to end every sequence, or one bool per
    row ([batch * beam], or [batch]) to end those sequences where they are."""

    def __call__(self, step: int, input_ids: Any, scores: Any) -> Any:
        raise NotImplementedError


class StoppingCriteriaList(list[StoppingCriteria], StoppingCriteria):
    """Several criteria: a sequence ends when any of them says so."""

    def __call__(self, step: int, input_ids: Any, scores: Any) -> Any:
        verdict: Any = False
        for criterion in self:
            verdict = np.logical_or(verdict, _host(criterion(step, input_ids, scores)))
        return verdict


# The Python runtime's name for the KV cache's bookkeeping: the executor's paged block manager.
KVCacheManager = BlockManager


@dataclass(eq=False, slots=True)
class GenerationState:
    """One batch in flight: every beam's generated tokens so far."""

    prompts: list[list[int]]
    beam_width: int
    pad_id: int
    request_ids: list[int]
    tokens: list[list[list[int]]] = field(default_factory=list)  # [batch][beam] generated tokens
    log_probs: list[list[list[float]]] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    step: int = 0  # generation steps completed
    scores: np.ndarray | None = None  # the last step's logits, [batch * beam, vocab], when hooks ran

    def __post_init__(self) -> None:
        n = len(self.prompts)
        self.tokens = [[[] for _ in range(self.beam_width)] for _ in range(n)]
        self.log_probs = [[[] for _ in range(self.beam_width)] for _ in range(n)]
        self.finished = [False] * n

    @property
    def all_finished(self) -> bool:
        return all(self.finished)

    def apply(self, index: int, response: Response) -> None:
        if response.error_msg is not None:
            raise RuntimeError(f"sequence {index} of the batch failed: {response.error_msg}")
        result = response.result
        assert result is not None
        lps = result.log_probs or [[] for _ in result.output_token_ids]
        if self.beam_width == 1:  # streamed: the new tokens
            self.tokens[index][0] += result.output_token_ids[0]
            self.log_probs[index][0] += lps[0]
        else:  # beams come whole, best first
            for beam, (ids, lp) in enumerate(zip(result.output_token_ids, lps, strict=True)):
                self.tokens[index][beam] = list(ids)
                self.log_probs[index][beam] = list(lp)
        self.finished[index] = self.finished[index] or result.is_final

    def sequences(self) -> list[list[int]]:
        """Every row's tokens, prompt included: [batch * beam] lists."""
        return [self.prompts[i] + self.tokens[i][b] for i in range(len(self.prompts)) for b in range(self.beam_width)]

    def input_ids(self) -> Any:
        """The batch's tokens as processors see them: [batch * beam, longest] int64, left-padded with pad_id."""
        import torch

        return torch.from_numpy(_left_padded(self.sequences(), self.pad_id))

    def outputs(self, max_length: int, max_new_tokens: int) -> dict[str, Any]:
        """output_ids [batch, beam, max_length] (pad_id padded), sequence_lengths
        [batch, beam], log_probs [batch, beam, max_new_tokens], cum_log_probs [batch, beam]."""
        import torch

        n, w = len(self.prompts), self.beam_width
        ids = np.full((n, w, max_length), self.pad_id, dtype=np.int64)
        lengths = np.zeros((n, w), dtype=np.int32)
        log_probs = np.zeros((n, w, max_new_tokens), dtype=np.float32)
        for i, prompt in enumerate(self.prompts):
            for b in range(w):
                row = (prompt + self.tokens[i][b])[:max_length]
                ids[i, b, : len(row)] = row
                lengths[i, b] = len(row)
                lp = self.log_probs[i][b][:max_new_tokens]
                log_probs[i, b, : len(lp)] = lp
        return {
            "output_ids": torch.from_numpy(ids),
            "sequence_lengths": torch.from_numpy(lengths),
            "log_probs": torch.from_numpy(log_probs),
            "cum_log_probs": torch.from_numpy(log_probs.sum(axis=2)),
        }


def _left_padded(rows: list[list[int]], pad_id: int) -> np.ndarray:
    """Rows padded at the front, so that column -1 is every row's latest token (as in
    transformers' decoder-only batches)."""
    out = np.full((len(rows), max(map(len, rows), default=0)), pad_id, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, out.shape[1] - len(row) :] = row
    return out


def split_batch(input_ids: Any, context_lengths: Any = None) -> list[list[int]]:
    """Prompts from a list of token lists (or 1-D tensors), a padded [batch, max_len]
    array or tensor cut at `context_lengths`, or a packed [num_tokens] one split by them."""
    lengths = None if context_lengths is None else [int(n) for n in np.asarray(_host(context_lengths)).reshape(-1)]
    if not hasattr(input_ids, "shape"):
        prompts = [[int(t) for t in np.asarray(_host(p)).reshape(-1)] for p in input_ids]
        return prompts if lengths is None else [p[:n] for p, n in zip(prompts, lengths, strict=True)]
    a = np.asarray(_host(input_ids)).astype(np.int64)
    if a.ndim == 2:
        return [row[:n].tolist() for row, n in zip(a, lengths or [a.shape[1]] * len(a), strict=True)]
    if a.ndim == 1:
        if lengths is None:
            raise ValueError("packed input_ids need context_lengths")
        if sum(lengths) != len(a):
            raise ValueError(f"context_lengths sum to {sum(lengths)}, packed input_ids hold {len(a)} tokens")
        ends = list(itertools.accumulate(lengths))
        return [a[e - n : e].tolist() for e, n in zip(ends, lengths, strict=True)]
    raise ValueError(f"input_ids: expected a [batch, length] or packed [num_tokens] tensor, got shape {a.shape}")


@dataclass(slots=True)
class _Setup:
    batch_size: int
    max_context_length: int
    max_new_tokens: int
    beam_width: int


class GenerationSession:
    def __init__(self, model_config: ModelConfig, engine: str | Path | EngineCore,
                 mapping: WorldConfig | None = None) -> None:  # fmt: skip
        """A session for `model_config` on `engine`: a checkpoint directory or .gguf
        file (tokenwire's "engine": it is loaded here) or a loaded EngineCore."""
        self.model_config = model_config
        self.mapping = mapping or WorldConfig()
        self.mapping.check_single_rank()
        if isinstance(engine, EngineCore):
            self.core = engine
        else:
            self.core = EngineCore.from_model(engine, model_config.executor_config(self.mapping))
        if self.core.model_config.vocab_size != model_config.vocab_size:
            raise ValueError(f"model_config.vocab_size {model_config.vocab_size} does not match the engine's "
                             f"{self.core.model_config.vocab_size}")
        if BATCHED in self.core.processors:
            raise ValueError(f"the engine already has a {BATCHED!r} logits post-processor; the session needs that slot")
        self.core.processors[BATCHED] = self._on_logits
        self._ids = itertools.count(1)
        self._setup: _Setup | None = None
        self._state: GenerationState | None = None
        self._logits_processor: LogitsProcessor | None = None

    # -- what the model is ----------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.model_config.num_layers

    @property
    def num_heads(self) -> int:
        return self.model_config.num_heads

    @property
    def hidden_size(self) -> int:
        return self.model_config.hidden_size

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.core.blocks

    # -- TensorRT-LLM's GenerationSession API --------------------------------------------

    def setup(self, batch_size: int, max_context_length: int, max_new_tokens: int, beam_width: int = 1) -> None:
        """Size the session for the batches `decode` will get."""
        cfg = self.model_config
        if not 1 <= batch_size <= cfg.max_batch_size:
            raise ValueError(f"batch_size {batch_size} is outside [1, max_batch_size={cfg.max_batch_size}]")
        if not 1 <= beam_width <= cfg.max_beam_width:
            raise ValueError(f"beam_width {beam_width} is outside [1, max_beam_width={cfg.max_beam_width}]")
        if max_context_length + max_new_tokens > cfg.max_seq_len:
            raise ValueError(f"max_context_length {max_context_length} + max_new_tokens {max_new_tokens} exceed "
                             f"the model's {cfg.max_seq_len} positions")
        self._setup = _Setup(batch_size, max_context_length, max_new_tokens, beam_width)

    def decode(self, input_ids: Any, context_lengths: Any, sampling_config: SamplingConfig, *,
               stop_words_list: Any = None, bad_words_list: Any = None, embedding_bias: Any = None,
               streaming: bool = False, output_sequence_lengths: bool = False, return_dict: bool = False,
               stopping_criteria: StoppingCriteria | None = None,
               logits_processor: LogitsProcessor | None = None) -> Any:  # fmt: skip
        """Generate for the batch. Returns output_ids [batch, beam, max_context_length +
        max_new_tokens], or with `return_dict` a dict that also holds sequence_lengths
        (and log_probs / cum_log_probs when the config asks); `streaming`: a generator
        of the same after each step."""
        cfg = sampling_config
        return_dict = return_dict or cfg.return_dict
        if stop_words_list is not None or bad_words_list is not None:
            cfg = replace(cfg, stop_words_list=cfg.stop_words_list if stop_words_list is None else stop_words_list,
                          bad_words_list=cfg.bad_words_list if bad_words_list is None else bad_words_list)
        prompts = split_batch(input_ids, context_lengths)
        args = (prompts, cfg, embedding_bias, stopping_criteria, logits_processor, return_dict,
                output_sequence_lengths or cfg.output_sequence_lengths)
        return self.decode_stream(*args) if streaming else self.decode_regular(*args)

    def decode_regular(self, prompts: list[list[int]], sampling_config: SamplingConfig, embedding_bias: Any = None,
                       stopping_criteria: StoppingCriteria | None = None,
                       logits_processor: LogitsProcessor | None = None, return_dict: bool = False,
                       output_sequence_lengths: bool = False) -> Any:  # fmt: skip
        """Generate to the end, then return the outputs (see `decode`)."""
        *_, state = self.generate_steps(prompts, sampling_config, embedding_bias, stopping_criteria,
                                        logits_processor)
        return self._outputs(state, sampling_config, return_dict, output_sequence_lengths)

    def decode_stream(self, prompts: list[list[int]], sampling_config: SamplingConfig, embedding_bias: Any = None,
                      stopping_criteria: StoppingCriteria | None = None,
                      logits_processor: LogitsProcessor | None = None, return_dict: bool = False,
                      output_sequence_lengths: bool = False) -> Iterator[Any]:  # fmt: skip
        """The outputs (see `decode`) after every generation step; the last are final."""
        for state in self.generate_steps(prompts, sampling_config, embedding_bias, stopping_criteria,
                                         logits_processor):
            yield self._outputs(state, sampling_config, return_dict, output_sequence_lengths)

    # -- the loop ------------------------------------------------------------------------

    def generate_steps(self, prompts: list[list[int]], sampling_config: SamplingConfig, embedding_bias: Any = None,
                       stopping_criteria: StoppingCriteria | None = None,
                       logits_processor: LogitsProcessor | None = None) -> Iterator[GenerationState]:  # fmt: skip
        """Run the batch on the core; yields its state after each step that produced tokens."""
        setup = self._checked_setup(prompts, sampling_config)
        cfg = sampling_config
        n = len(prompts)
        hooks = stopping_criteria is not None or logits_processor is not None
        state = GenerationState(prompts, setup.beam_width, self._pad_id(cfg), [next(self._ids) for _ in prompts])
        requests = [(rid, self._request(prompts[i], i, n, cfg, embedding_bias, hooks))
                    for i, rid in enumerate(state.request_ids)]
        where = {rid: i for i, rid in enumerate(state.request_ids)}
        self._state, self._logits_processor = state, logits_processor
        try:
            self.core.add_requests(requests)
            while not state.all_finished:
                out = self.core.step()
                responses = out.all_responses()
                for response in responses:
                    state.apply(where[response.request_id], response)
                if not responses:
                    if not self.core.has_work:
                        raise RuntimeError("the engine stopped with sequences unfinished")
                    continue
                state.step += 1
                if stopping_criteria is not None and not state.all_finished:
                    self._stop_where_asked(state, stopping_criteria)
                yield state
        finally:
            self._state, self._logits_processor = None, None
            if not state.all_finished:  # abandoned (an error, or a stream closed early): free the batch
                for i, rid in enumerate(state.request_ids):
                    if not state.finished[i]:
                        self.core.abort(rid)
                while self.core.has_work:
                    self.core.step()

    def _end_id(self, cfg: SamplingConfig) -> int:
        eos = self.core.model_config.eos_token_ids
        return cfg.end_id if cfg.end_id is not None else (eos[0] if eos else -1)

    def _pad_id(self, cfg: SamplingConfig) -> int:
        return cfg.pad_id if cfg.pad_id is not None else max(self._end_id(cfg), 0)

    def _checked_setup(self, prompts: list[list[int]], cfg: SamplingConfig) -> _Setup:
        if self._setup is None:
            raise RuntimeError("call setup(batch_size, max_context_length, max_new_tokens, beam_width) first")
        setup = self._setup
        if not prompts or len(prompts) > setup.batch_size:
            raise ValueError(f"a batch of {len(prompts)} sequences; setup() was for 1 to {setup.batch_size}")
        longest = max(map(len, prompts))
        if longest > setup.max_context_length:
            raise ValueError(f"a prompt of {longest} tokens; setup() was for at most {setup.max_context_length}")
        if cfg.max_new_tokens > setup.max_new_tokens:
            raise ValueError(f"max_new_tokens {cfg.max_new_tokens}; setup() was for at most {setup.max_new_tokens}")
        if cfg.beam_width != setup.beam_width:
            raise ValueError(f"beam_width {cfg.beam_width}; setup() was for {setup.beam_width}")
        return setup

    def _request(self, prompt: list[int], index: int, batch_size: int, cfg: SamplingConfig, embedding_bias: Any,
                 hooks: bool) -> Request:  # fmt: skip
        bias = None
        if embedding_bias is not None:
            bias = np.asarray(_host(embedding_bias), dtype=np.float32).reshape(-1).tolist()
        return Request(
            input_token_ids=prompt,
            max_tokens=cfg.max_new_tokens,
            streaming=True,
            sampling_config=cfg.for_sequence(index, batch_size),
            output_config=OutputConfig(return_log_probs=True),
            end_id=self._end_id(cfg),
            pad_id=self._pad_id(cfg),
            stop_words=cfg.words("stop_words_list", index, batch_size),
            bad_words=cfg.words("bad_words_list", index, batch_size),
            embedding_bias=bias,
            num_return_sequences=cfg.beam_width,
            logits_post_processor_name=BATCHED if hooks else None,
        )

    def _on_logits(self, request_ids: list[int], logits: list[np.ndarray], tokens: list[list[list[int]]],
                   client_ids: list[int | None]) -> None:  # fmt: skip
        """The core's batched post-processor: one call per step, the batch's rows in place."""
        state = self._state
        if state is None:
            return
        import torch

        w = state.beam_width
        rows = state.sequences()
        places: list[tuple[int, int]] = []  # (row in the batch, logits list entry / its row)
        index = {rid: i for i, rid in enumerate(state.request_ids)}
        for k, (rid, beam_tokens) in enumerate(zip(request_ids, tokens, strict=True)):
            for b, seq in enumerate(beam_tokens):
                rows[index[rid] * w + b] = list(seq)
                places.append((index[rid] * w + b, k * w + b))
        scores = np.zeros((len(rows), logits[0].shape[1]), dtype=np.float32)
        for row, at in places:
            scores[row] = logits[at // w][at % w]
        if self._logits_processor is not None:
            new = self._logits_processor(state.step, torch.from_numpy(_left_padded(rows, state.pad_id)),
                                         torch.from_numpy(scores))
            scores = np.asarray(_host(scores if new is None else new), dtype=np.float32)
            for row, at in places:
                logits[at // w][at % w] = scores[row]
        state.scores = scores

    def _stop_where_asked(self, state: GenerationState, criteria: StoppingCriteria) -> None:
        import torch

        scores = state.scores if state.scores is not None else np.zeros((0, self.vocab_size), dtype=np.float32)
        verdict = np.asarray(_host(criteria(state.step - 1, state.input_ids(), torch.from_numpy(scores))))
        n, w = len(state.prompts), state.beam_width
        if verdict.ndim == 0:
            stop = [bool(verdict)] * n
        elif verdict.size == n:
            stop = [bool(v) for v in verdict.reshape(-1)]
        elif verdict.size == n * w:
            stop = [bool(v) for v in np.asarray(verdict.reshape(n, w).any(axis=1)).reshape(-1)]
        else:
            raise ValueError(f"a stopping criterion returned {verdict.size} values for {n} sequences x {w} beams")
        for i, rid in enumerate(state.request_ids):
            if stop[i] and not state.finished[i]:
                self.core.abort(rid)

    def outputs(self, state: GenerationState) -> dict[str, Any]:
        """The batch's tensors as setup() sized them (GenerationState.outputs)."""
        setup = self._setup
        assert setup is not None
        return state.outputs(setup.max_context_length + setup.max_new_tokens, setup.max_new_tokens)

    def _outputs(self, state: GenerationState, cfg: SamplingConfig, return_dict: bool,
                 output_sequence_lengths: bool) -> Any:  # fmt: skip
        out = self.outputs(state)
        if not return_dict:
            return (out["output_ids"], out["sequence_lengths"]) if output_sequence_lengths else out["output_ids"]
        if not (cfg.output_log_probs or cfg.output_cum_log_probs):
            del out["log_probs"], out["cum_log_probs"]
        return out
