"""A request's sampling and output options, declared once.

Each option is a field of a plain dataclass here, with its type, its default,
its bounds and what it means. Every other form is derived from these fields:
the executor's `SamplingConfig` / `OutputConfig` are these classes; the wire
models of the same names (protocol/request.py) are built from their fields,
bounds included; `clients.params` maps `SamplingParams` onto them by their
names; worker/runtime maps its per-sequence vectors onto them. Adding an
option here adds it to the wire, the executor and the client's mapping
(`SamplingParams` itself lists its options flat, with the same names and
defaults; tests/protocol/test_options.py holds it to them). protocol/stats.py
declares its records with the same `option`.

Plain dataclasses rather than a pydantic model, and no import of anything:
the executor runs where pydantic is not installed (the GPU host), and the
executor checks the same bounds for in-process callers that the wire model
checks for untrusted ones (`out_of_bounds`). Dataclasses rather than a table
of specs, so that type checkers see every field where it is used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

# The most alternatives returned per generated token: each costs a sort over the
# vocabulary row and a list per token in every result.
MAX_TOP_N_LOG_PROBS = 64
UINT64_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Bounds:
    """The range an option's value must lie in (None: unbounded on that side)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def describe(self) -> str:
        """`in [0, 1]`, `in (0, 1]`, `>= 0` or `> 0`."""
        low = self.ge if self.ge is not None else self.gt
        if self.le is not None:
            opening = "[" if self.ge is not None else "("
            return f"in {opening}{_number(low)}, {_number(self.le)}]"
        return f"{'>=' if self.ge is not None else '>'} {_number(low)}"

    def admits(self, value: float) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le))

    @property
    def unbounded(self) -> bool:
        return self.ge is None and self.gt is None and self.le is None


def _number(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# The default of a field that has none: the caller must give it.
REQUIRED: Any = MISSING


def option(default: Any, doc: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
           factory: Callable[[], Any] | None = None) -> Any:
    """A field of a declaring dataclass: its default (REQUIRED: none; `factory`:
    made per instance), what it means, and its bounds."""
    metadata = {"doc": doc, "bounds": Bounds(ge, gt, le)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def option_bounds(options: type | object) -> dict[str, Bounds]:
    """Each bounded option of an options class (or instance), by name."""
    found = {f.name: f.metadata["bounds"] for f in fields(options)}  # type: ignore[arg-type]
    return {name: bounds for name, bounds in found.items() if not bounds.unbounded}


def out_of_bounds(options: object, prefix: str) -> str | None:
    """The first option of `options` outside its bounds, as an error message that
    names it (`{prefix}.top_p must be in [0, 1], got 1.5`); None when all fit."""
    for name, bounds in option_bounds(options).items():
        value = getattr(options, name)
        if value is not None and not bounds.admits(value):
            return f"{prefix}.{name} must be {bounds.describe()}, got {value}"
    return None


@dataclass(slots=True)
class SamplingConfig:
    """How to pick the next token. `None` means the executor default."""

    beam_width: int = option(1, "beams kept by beam search; 1: sampling or greedy", ge=1)
    top_k: int | None = option(None, "sample among the k likeliest tokens; 0 or None: no top-k", ge=0)
    top_p: float | None = option(
        None, "sample among the likeliest tokens holding this much probability; None or 1: no top-p, "
        "0: off (greedy when top_k is 0 too)", ge=0.0, le=1.0)
    top_p_min: float | None = option(None, "top-p decay: the floor top_p decays to", gt=0.0, le=1.0)
    top_p_reset_ids: int | None = option(None, "top-p decay: the token that resets top_p", ge=-1)
    top_p_decay: float | None = option(None, "top-p decay: the factor top_p shrinks by each step", gt=0.0, le=1.0)
    min_p: float | None = option(None, "drop tokens less likely than min_p times the likeliest", ge=0.0, le=1.0)
    seed: int | None = option(None, "the random seed of this request's sampling", ge=0, le=UINT64_MAX)
    temperature: float | None = option(None, "divides the logits; None: 1.0, 0: greedy", ge=0.0)
    min_tokens: int | None = option(None, "tokens generated before the end token may end the output", ge=0)
    beam_search_diversity_rate: float | None = option(
        None, "beam search: penalty on beams that share a parent", ge=0.0)
    repetition_penalty: float | None = option(
        None, "multiplicative, over the prompt's and the output's tokens; None or 1: off", gt=0.0)
    presence_penalty: float | None = option(None, "additive, over the output's tokens")
    frequency_penalty: float | None = option(None, "additive times the count, over the output's tokens")
    length_penalty: float | None = option(None, "beam search: a beam's score is divided by its length to this")
    early_stopping: int | None = option(
        None, "beam search: 1 stops at beam_width finished beams, 0 when none can improve, -1 never "
        "before max_tokens")
    no_repeat_ngram_size: int | None = option(None, "no n-gram of this size occurs twice; 0 or None: off", ge=0)

    @property
    def is_greedy(self) -> bool:
        # As in TensorRT-LLM, a config that asks for no randomness decodes greedily,
        # and so does top_k = 0 with top_p = 0 (TensorRT-LLM's defaults for both).
        unset = all(v is None for v in (self.temperature, self.top_k, self.top_p, self.min_p))
        both_zero = not self.top_k and self.top_p == 0.0
        return unset or both_zero or self.temperature == 0.0 or self.top_k == 1


@dataclass(slots=True)
class OutputConfig:
    """What a result carries besides the generated tokens."""

    return_log_probs: bool = option(False, "each generated token's log prob, and each beam's sum")
    return_context_logits: bool = option(False, "the prompt's logits [prompt tokens, vocab]")
    return_generation_logits: bool = option(False, "the generated tokens' logits [beams, new tokens, vocab]")
    # TensorRT-LLM defaults this to False (outputs repeat the prompt); a service
    # almost never wants the prompt echoed, so we default to True.
    exclude_input_from_output: bool = option(True, "outputs hold the generated tokens only, not the prompt")
    top_n_log_probs: int = option(
        0, "per generated token, the n likeliest tokens and their log probs", ge=0, le=MAX_TOP_N_LOG_PROBS)
    prompt_log_probs: int | None = option(
        None, "each prompt token's log prob and the k likeliest tokens at its position (None: off)",
        ge=0, le=MAX_TOP_N_LOG_PROBS)
