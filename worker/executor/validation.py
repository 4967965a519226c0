"""Checks a request against the model and the executor's limits.

The wire models validate types and ranges for untrusted input; these checks
need the model (vocabulary, context) and also guard in-process callers. The
options' ranges (protocol/options.py) and the vocabulary and context rules
(protocol/model_fit.py) are the ones the wire and the gateway apply.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from protocol.continuation import continuation_problem
from protocol.model_fit import context_overflow, token_outside_vocabulary
from protocol.options import out_of_bounds
from worker.executor.types import ExecutorConfig, PackedWordList, Request, WordList
from worker.models.config import ModelConfig


class RequestError(ValueError):
    """A request that cannot be served; the message says which field and why."""


def normalize_word_list(words: WordList | None, name: str) -> list[list[int]]:
    """The words of a word list: a plain list always means one word per entry;
    TensorRT-LLM's [2, len] form comes as a PackedWordList."""
    if not words:
        return []
    if isinstance(words, PackedWordList):
        try:
            return words.words()
        except ValueError as e:
            raise RequestError(f"{name}: {e}") from None
    for i, word in enumerate(words):
        if not word:
            raise RequestError(f"{name}[{i}] is empty")
    return [list(w) for w in words]


def validate_request(request: Request, model: ModelConfig, config: ExecutorConfig, max_seq_len: int,
                     processors: Mapping[str, object] | None = None) -> None:
    prompt = request.input_token_ids
    if not prompt:
        raise RequestError("input_token_ids is empty: a prompt needs at least one token")
    table = _prompt_table_rows(request, model)
    problem = token_outside_vocabulary(prompt, model.vocab_size, table)
    if problem is not None:
        raise RequestError(problem)
    if request.max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {request.max_tokens}")
    problem = context_overflow(len(prompt), request.max_tokens, max_seq_len)
    if problem is not None:
        raise RequestError(problem)
    if not config.enable_chunked_context and len(prompt) > config.max_num_tokens:
        raise RequestError(
            f"prompt ({len(prompt)} tokens) exceeds max_num_tokens ({config.max_num_tokens}) "
            "and chunked context is off"
        )
    cfg = request.sampling_config
    if cfg.beam_width < 1 or cfg.beam_width > config.max_beam_width:
        raise RequestError(
            f"sampling_config.beam_width {cfg.beam_width} is outside [1, max_beam_width={config.max_beam_width}]"
        )
    # Every option's own range, as the wire model checks it for untrusted input.
    problem = out_of_bounds(cfg, "sampling_config") or out_of_bounds(request.output_config, "output_config")
    if problem is not None:
        raise RequestError(problem)
    if request.num_return_sequences < 1:
        raise RequestError(f"num_return_sequences must be >= 1, got {request.num_return_sequences}")
    if request.end_id is not None and not -1 <= request.end_id < model.vocab_size:
        raise RequestError(f"end_id {request.end_id} is outside the vocabulary (use -1 for none)")
    for name in ("stop_words", "bad_words"):
        for word in normalize_word_list(getattr(request, name), name):
            if any(not 0 <= t < model.vocab_size for t in word):
                raise RequestError(f"{name}: token id outside the vocabulary in {word}")
    _check_decoding(request, model)
    problem = continuation_problem(request, model.vocab_size)
    if problem is not None:
        raise RequestError(problem)
    processor = request.logits_post_processor_name
    if processor is not None and processor not in (processors or {}):
        known = ", ".join(sorted(processors or {})) or "none"
        raise RequestError(
            f"logits_post_processor_name: unknown logits post-processor {processor!r} (configured: {known})")
    if request.embedding_bias is not None and len(request.embedding_bias) != model.vocab_size:
        raise RequestError(
            f"embedding_bias has {len(request.embedding_bias)} values; the vocabulary has {model.vocab_size} tokens")


def _prompt_table_rows(request: Request, model: ModelConfig) -> int:
    """Rows of the request's prompt-tuning table (0 without one), checked against the model."""
    config = request.prompt_tuning_config
    if config is None:
        return 0
    table = config.embedding_table
    if not isinstance(table, np.ndarray) or table.ndim != 2 or table.dtype.kind != "f":
        shape = getattr(table, "shape", None)
        raise RequestError(f"prompt_tuning_config.embedding_table must be a float array [rows, hidden], got "
                           f"{type(table).__name__} {shape}")
    if table.shape[1] != model.hidden_size:
        raise RequestError(f"prompt_tuning_config.embedding_table is {table.shape[1]} wide; the model's hidden "
                           f"size is {model.hidden_size}")
    if not np.isfinite(table).all():
        raise RequestError("prompt_tuning_config.embedding_table holds a NaN or infinite value")
    cfg = request.sampling_config
    # These read the prompt's token ids as vocabulary entries, which table rows are not.
    if cfg.repetition_penalty not in (None, 1.0) or cfg.presence_penalty or cfg.frequency_penalty \
            or cfg.no_repeat_ngram_size:
        raise RequestError("repetition / presence / frequency penalties and no_repeat_ngram_size are not "
                           "supported with prompt tuning")
    return int(table.shape[0])


def _check_decoding(request: Request, model: ModelConfig) -> None:
    cfg = request.sampling_config
    out = request.output_config
    if cfg.top_p_reset_ids is not None and not -1 <= cfg.top_p_reset_ids < model.vocab_size:
        raise RequestError(f"sampling_config.top_p_reset_ids {cfg.top_p_reset_ids} is outside the vocabulary")
    if cfg.beam_width > 1:
        if request.num_return_sequences > cfg.beam_width:
            raise RequestError(f"num_return_sequences ({request.num_return_sequences}) must not exceed "
                               f"sampling_config.beam_width ({cfg.beam_width}) in beam search")
        unsupported = [name for name, used in (
            ("guided_decoding_params", request.guided_decoding_params is not None),
            ("output_config.return_generation_logits", out.return_generation_logits),
            ("output_config.top_n_log_probs", out.top_n_log_probs > 0),
            ("output_config.prompt_log_probs", out.prompt_log_probs is not None),
        ) if used]
        if unsupported:
            raise RequestError(f"{unsupported[0]} is not supported with beam search (beam_width > 1)")
