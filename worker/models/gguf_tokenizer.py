"""The tokenizer of a GGUF file, rebuilt from the vocabulary llama.cpp stores as metadata,
as a `tokenizers.Tokenizer` (the library the rest of tokenwire tokenizes with).

Two kinds of vocabulary (`tokenizer.ggml.model`):
- "gpt2": byte-level BPE (Llama 3, Qwen, SmolLM, Phi-4): tokens and merges are stored;
  the pre-tokenizer's split regex is named by `tokenizer.ggml.pre`.
- "llama": SentencePiece BPE (Llama 2, Mistral, Gemma, Phi-3): tokens, their scores and
  types are stored, no merges. SentencePiece merges the adjacent pair whose joined piece
  scores highest; a BPE model whose merges are every split of every normal piece into two
  normal pieces, ranked by the joined piece's score, makes the same choices. Spaces are
  spelled "▁" (with one prepended to the text when `tokenizer.ggml.add_space_prefix`,
  llama.cpp's default), and characters outside the vocabulary fall back to byte tokens
  (`<0x0A>`). The prefix space follows Hugging Face's SentencePiece-BPE tokenizers (so a
  GGUF file tokenizes as its Hugging Face checkpoint does): one text that already begins
  with a space gets no second one, where SentencePiece would add it.

Settings that would change how text is split but are not built here (SentencePiece's
whitespace folding, a precompiled normalization map) fail the load naming them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from worker.models.config import CheckpointError

# llama.cpp's token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
_SPACE = "▁"

# tokenizer.ggml.pre -> the pre-tokenizer split regex the vocabulary was trained with.
# None means the ByteLevel pre-tokenizer's own (GPT-2) regex.
_GPT2_SPLIT = None
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": _GPT2_SPLIT,
    "gpt-2": _GPT2_SPLIT,
    "smollm": _GPT2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


def build_tokenizer(meta: dict[str, Any], path: Path) -> Tokenizer:
    """The tokenizer of the vocabulary in `meta` (a GGUF file's metadata)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(meta, path)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(meta, path)
    else:
        raise CheckpointError(
            f"{path}: tokenizer.ggml.model {kind!r} is not supported "
            "(supported: 'gpt2', byte-level BPE; 'llama', SentencePiece BPE)"
        )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_text = meta["tokenizer.ggml.tokens"][int(bos)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_text}:0 $A:0", pair=f"{bos_text}:0 $A:0 $B:1", special_tokens=[(bos_text, int(bos))]
        )
    elif kind == "gpt2":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """What a Hugging Face checkpoint's tokenizer_config.json would say of the special tokens."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    cfg: dict[str, Any] = {"add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False))}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            cfg[f"{name}_token"] = tokens[int(token_id)]
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    return cfg


def _required(meta: dict[str, Any], path: Path, *keys: str) -> None:
    for key in keys:
        if key not in meta:
            raise CheckpointError(f"{path}: metadata field {key!r} is missing")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_bpe(meta: dict[str, Any], path: Path) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZER_SPLITS:
        raise CheckpointError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(_PRE_TOKENIZER_SPLITS)})"
        )
    _required(meta, path, "tokenizer.ggml.tokens", "tokenizer.ggml.merges")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Tokens with characters outside the byte alphabet are stored as plain text; respell them.
    vocab = {
        (t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, continuing_subword_prefix="", end_of_word_suffix="")
    )
    split = _PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) must match whole and count as special; a
    # "control" token spelled outside the byte alphabet is a llama.cpp mislabel, skipped.
    control = [t for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL and set(t) <= spelled]
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED and t in vocab]
    _add_whole_tokens(tokenizer, control, user)
    return tokenizer


def _sentencepiece_bpe(meta: dict[str, Any], path: Path) -> Tokenizer:
    _required(meta, path, "tokenizer.ggml.tokens", "tokenizer.ggml.scores")
    if meta.get("tokenizer.ggml.remove_extra_whitespaces", False):
        raise CheckpointError(f"{path}: tokenizer.ggml.remove_extra_whitespaces is true (whitespace folding) "
                              "and is not supported")  # fmt: skip
    if meta.get("tokenizer.ggml.precompiled_charsmap"):
        raise CheckpointError(f"{path}: tokenizer.ggml.precompiled_charsmap (a normalization map) is not supported")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    scores: list[float] = [float(s) for s in meta["tokenizer.ggml.scores"]]
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    if not len(tokens) == len(scores) == len(types):
        raise CheckpointError(f"{path}: {len(tokens)} tokens, {len(scores)} scores and {len(types)} token types")
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if unk_id is None:
        unk_id = next((i for i, ty in enumerate(types) if ty == _UNKNOWN), None)
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=_merges_by_score(tokens, scores, types),
                   unk_token=None if unk_id is None else tokens[int(unk_id)], fuse_unk=True, byte_fallback=True)
    )  # fmt: skip
    # As Hugging Face's own SentencePiece-BPE tokenizers are built: spaces spelled and the
    # prefix space added by the pre-tokenizer, before the text's first piece only (not after
    # a whole token inside it, as SentencePiece itself does not either).
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    _add_whole_tokens(
        tokenizer,
        [t for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL],
        [t for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED],
    )
    return tokenizer


def _merges_by_score(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, the joined piece's score first
    (then the halves' ids): the order SentencePiece's BPE picks pairs in."""
    normal = {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty == _NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], normal[left], normal[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _add_whole_tokens(tokenizer: Tokenizer, control: list[str], user: list[str]) -> None:
    """Control tokens match whole and count as special; user-defined ones match whole."""
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
