"""The runtime's SamplingConfig: the executor's sampling options for a whole
batch, where each option is one value for every sequence or one per sequence
(a size-1 vector broadcasts), as TensorRT-LLM's runtime SamplingConfig.

It carries no option of its own beyond the batch's (end_id, pad_id,
max_new_tokens, word lists, what to return): `for_sequence` maps it, name for
name, onto the executor's SamplingConfig, which does the sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import InitVar, dataclass, fields
from typing import Any, get_type_hints

import numpy as np

from worker.executor import PackedWordList
from worker.executor import SamplingConfig as RequestSampling
from worker.executor.types import WordList

# The runtime's names for executor SamplingConfig options (TensorRT-LLM's runtime
# spells these two differently); every other option keeps its name.
_RENAMED = {"seed": "random_seed", "min_tokens": "min_length"}
# runtime name -> the executor SamplingConfig option it sets, per sequence (beam_width
# is one for the whole batch)
_PER_SEQUENCE = {_RENAMED.get(f.name, f.name): f.name for f in fields(RequestSampling) if f.name != "beam_width"}
# The integer options: a vector's entries arrive as floats or numpy scalars.
_INTEGER = {name for name, hint in get_type_hints(RequestSampling).items() if hint == int | None}

Vector = float | int | Sequence[float] | Sequence[int] | Any  # a number, or a 1-D list / array / tensor


@dataclass(slots=True, kw_only=True)
class SamplingConfig:
    end_id: int | None = None  # None: the model's end-of-sequence token; -1: none
    pad_id: int | None = None  # None: end_id
    max_new_tokens: int = 20
    beam_width: int = 1  # one width for the whole batch (num_beams)
    num_beams: InitVar[int | None] = None  # TensorRT-LLM's Python name for beam_width
    # Per sequence or for all; None: the executor's default (all None: greedy).
    temperature: Vector | None = None
    top_k: Vector | None = None  # top_k = 0 with top_p = 0: greedy
    top_p: Vector | None = None
    top_p_decay: Vector | None = None
    top_p_min: Vector | None = None
    top_p_reset_ids: Vector | None = None
    min_p: Vector | None = None
    random_seed: Vector | None = None  # None: 0
    min_length: Vector | None = None
    repetition_penalty: Vector | None = None  # 0 (the C++ runtime's default) or None: off
    presence_penalty: Vector | None = None
    frequency_penalty: Vector | None = None
    no_repeat_ngram_size: Vector | None = None
    length_penalty: Vector | None = None
    early_stopping: Vector | None = None
    beam_search_diversity_rate: Vector | None = None
    # Words per sequence or for all: lists of token lists, PackedWordList, or the
    # [2, len] / [batch, 2, len] tensors of TensorRT-LLM (always the packed form).
    stop_words_list: Any = None
    bad_words_list: Any = None
    # What generate / decode return.
    output_sequence_lengths: bool = False
    return_dict: bool = False
    output_log_probs: bool = False
    output_cum_log_probs: bool = False

    def __post_init__(self, num_beams: int | None) -> None:
        if num_beams is not None:
            self.beam_width = num_beams

    def update(self, **options: Any) -> SamplingConfig:
        """Set fields by name (ModelRunner.generate's keyword overrides); an unknown one raises."""
        for name, value in options.items():
            if name == "num_beams":
                name = "beam_width"
            if name not in self.__dataclass_fields__:
                raise TypeError(f"SamplingConfig has no option {name!r}")
            setattr(self, name, value)
        return self

    def for_sequence(self, index: int, batch_size: int) -> RequestSampling:
        """The executor's SamplingConfig of sequence `index` of the batch."""
        values = {executor: _pick(getattr(self, name), name, index, batch_size)
                  for name, executor in _PER_SEQUENCE.items()}
        if values["repetition_penalty"] == 0:
            values["repetition_penalty"] = None
        for name in _INTEGER:
            if values.get(name) is not None:
                values[name] = int(values[name])
        return RequestSampling(beam_width=self.beam_width, **values)

    def words(self, which: str, index: int, batch_size: int) -> WordList | None:
        """Sequence `index`'s stop ("stop_words_list") or bad ("bad_words_list") words."""
        return word_list_for(getattr(self, which), index, batch_size, which)


def _pick(value: Any, name: str, index: int, batch_size: int) -> Any:
    if value is None or np.ndim(value) == 0:
        return None if value is None else _number(value)
    items = [_number(v) for v in np.asarray(_host(value)).reshape(-1).tolist()]
    if len(items) == 1:
        return items[0]
    if len(items) != batch_size:
        raise ValueError(
            f"SamplingConfig.{name}: {len(items)} values for a batch of {batch_size} (give 1 or {batch_size})")
    return items[index]


def _number(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def _host(value: Any) -> Any:
    """A torch tensor (on any device) as numpy; anything else as it is."""
    return value.detach().cpu().numpy() if hasattr(value, "detach") else value


def word_list_for(value: Any, index: int, batch_size: int, name: str) -> WordList | None:
    """One sequence's words from a batch-level value: None; a PackedWordList or a
    list of token lists (every sequence's); a [2, len] array or tensor (packed, every
    sequence's) or [batch, 2, len] (one per sequence); or a list with one entry per
    sequence of any of these."""
    if value is None or isinstance(value, PackedWordList):
        return value
    if hasattr(value, "shape"):  # numpy array or tensor: TensorRT-LLM's packed form
        a = np.asarray(_host(value)).astype(np.int64)
        if a.ndim == 2 and a.shape[0] == 2:
            return PackedWordList(a[0].tolist(), a[1].tolist())
        if a.ndim == 3 and a.shape[1] == 2:
            return word_list_for(a[_batch_index(len(a), index, batch_size, name)], index, batch_size, name)
        raise ValueError(f"{name}: expected a [2, len] or [batch, 2, len] array, got shape {a.shape}")
    items = list(value)
    if not items:
        return None
    if all(isinstance(w, Sequence) and all(isinstance(t, int | np.integer) for t in w) for w in items):
        return [[int(t) for t in w] for w in items]  # plain lists always mean words
    return word_list_for(items[_batch_index(len(items), index, batch_size, name)], index, batch_size, name)


def _batch_index(n: int, index: int, batch_size: int, name: str) -> int:
    if n == 1:
        return 0
    if n != batch_size:
        raise ValueError(f"{name}: {n} word lists for a batch of {batch_size} (give 1 or {batch_size})")
    return index
