"""Logits post-processors: named callbacks that change a request's logits
before sampling (TensorRT-LLM's LogitsPostProcessorConfig, with numpy arrays).

    per request:  fn(request_id, logits, tokens, client_id) -> logits | None
    batched:      fn(request_ids, logits_list, tokens_list, client_ids) -> None

`logits` is float32 [beams, vocab] on the host (change it in place, or return a
new array of that shape); `tokens` holds each beam's tokens so far, prompt
included. The batched callback is registered under the name BATCHED and changes
the arrays of every request that picked it in one call. Requests pick one by
`Request.logits_post_processor_name`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

BATCHED = "batched"  # TensorRT-LLM's Request::kBatchedPostProcessorName

LogitsPostProcessor = Callable[[int, np.ndarray, list[list[int]], int | None], np.ndarray | None]
BatchedLogitsPostProcessor = Callable[[list[int], list[np.ndarray], list[list[list[int]]], list[int | None]], None]


def load_processors(specs: Iterable[str]) -> dict[str, Any]:
    """{"name": callable} from "name=package.module:function" entries, for a
    service whose config names processors by import path (clients cannot send
    code). A bad entry raises ValueError naming it."""
    processors: dict[str, Any] = {}
    for spec in specs:
        name, sep, target = spec.partition("=")
        module_name, colon, attr = target.partition(":")
        if not (sep and colon and name.strip() and module_name.strip() and attr.strip()):
            raise ValueError(f"logits post-processor {spec!r}: expected 'name=package.module:function'")
        name = name.strip()
        if name in processors:
            raise ValueError(f"logits post-processor {name!r} is configured twice")
        try:
            obj: Any = importlib.import_module(module_name.strip())
            for part in attr.strip().split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"logits post-processor {name!r}: cannot import {target!r}: {e}") from None
        if not callable(obj):
            raise ValueError(f"logits post-processor {name!r}: {target!r} is not callable")
        processors[name] = obj
    return processors


Row = tuple[int, str, np.ndarray, list[list[int]], int | None]


def apply_processors(processors: dict[str, Any], rows: list[Row]) -> tuple[list[np.ndarray], dict[int, str]]:
    """Run each (request id, processor name, logits [beams, vocab], tokens, client id)
    through its processor. Returns the new logits in order, and {row index: error}
    for rows whose processor failed (those requests end with that error)."""
    out = [logits for _, _, logits, _, _ in rows]
    errors: dict[int, str] = {}
    batched = [i for i, row in enumerate(rows) if row[1] == BATCHED]
    for i, (request_id, name, logits, tokens, client_id) in enumerate(rows):
        if name == BATCHED:
            continue
        try:
            new = processors[name](request_id, logits, tokens, client_id)
            if new is not None:
                out[i] = _checked(np.asarray(new, dtype=np.float32), logits.shape, name)
        except Exception as e:
            errors[i] = f"logits post-processor {name!r} failed: {type(e).__name__}: {e}"
    if batched:
        try:
            processors[BATCHED]([rows[i][0] for i in batched], [out[i] for i in batched],
                                [rows[i][3] for i in batched], [rows[i][4] for i in batched])
        except Exception as e:
            errors.update({i: f"logits post-processor {BATCHED!r} failed: {type(e).__name__}: {e}" for i in batched})
    return out, errors


def _checked(new: np.ndarray, shape: tuple[int, ...], name: str) -> np.ndarray:
    if new.shape != shape:
        raise ValueError(f"returned shape {new.shape}, expected {shape}")
    return new
