"""Guided decoding with XGrammar (the `guided` extra): JSON, JSON schema, regex
and EBNF grammars compiled against the model's tokenizer. Each guided sequence
owns a matcher that accepts its tokens; before each step, the matcher's bitmask
of allowed next tokens goes to the batched sampler (SamplingBatch.token_mask)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from worker.executor.types import GuidedDecodingParams
from worker.executor.validation import RequestError

GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise RequestError(
            "guided_decoding_params: guided decoding needs XGrammar, which is not installed on this worker "
            "(install the `guided` extra: pip install 'tokenwire[guided]')"
        ) from None
    return xgrammar


class GuidedDecoder:
    """Compiles guides for one tokenizer; compiled grammars are cached by XGrammar."""

    def __init__(self, encoded_vocab: list[str], tokenizer_str: str | None, vocab_size: int,
                 stop_token_ids: list[int]) -> None:  # fmt: skip
        """`encoded_vocab`: each token's string, by id; `tokenizer_str`: the tokenizer.json
        text its byte-level / sentencepiece encoding is read from (None: raw strings)."""
        xgr = _xgrammar()
        if tokenizer_str is not None:
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer_str)
            vocab_type, prefix_space = meta["vocab_type"], meta["add_prefix_space"]
        else:
            vocab_type, prefix_space = xgr.VocabType.RAW, False
        info = xgr.TokenizerInfo(encoded_vocab, vocab_type, vocab_size=vocab_size,
                                 stop_token_ids=stop_token_ids or None, add_prefix_space=prefix_space)
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.vocab_size = vocab_size

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> GuidedDecoder:
        """For a `tokenizers.Tokenizer` (the model's own)."""
        _xgrammar()
        if tokenizer is None:
            raise RequestError("guided_decoding_params: this executor has no tokenizer to compile grammars against")
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        encoded = [token for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
        return cls(encoded, tokenizer.to_str(), vocab_size, stop_token_ids)

    def compile(self, params: GuidedDecodingParams) -> Any:
        """The compiled grammar; a bad guide is a RequestError naming the problem."""
        kind, guide = params.guide_type, params.guide
        if kind not in GUIDE_TYPES:
            raise RequestError(f"guided_decoding_params.guide_type {kind!r} is not one of {', '.join(GUIDE_TYPES)}")
        if kind != "json" and not guide:
            raise RequestError(f"guided_decoding_params: guide_type {kind!r} needs a guide")
        try:
            if kind == "json":
                return self._compiler.compile_builtin_json_grammar()
            if kind == "json_schema":
                json.loads(guide)  # type: ignore[arg-type]
                # Compact JSON: free whitespace lets a small model pad until max_tokens.
                return self._compiler.compile_json_schema(guide, any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(guide)
            return self._compiler.compile_grammar(guide)
        except (RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RequestError(f"guided_decoding_params: invalid {kind} guide: {first}") from None

    def matcher(self, compiled: Any, end_id: int) -> Guide:
        m = self._xgr.GrammarMatcher(compiled, override_stop_tokens=[end_id] if end_id >= 0 else None)
        return Guide(m, -(-self.vocab_size // 32))


class Guide:
    """One sequence's grammar state."""

    __slots__ = ("matcher", "words")

    def __init__(self, matcher: Any, words: int) -> None:
        self.matcher = matcher
        self.words = words

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar rejects it."""
        return bool(self.matcher.accept_token(token))

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


def fill_masks(guides: list[Guide]) -> np.ndarray:
    """int32 [len(guides), ceil(vocab / 32)]: each guide's allowed next tokens."""
    mask = np.zeros((len(guides), guides[0].words), dtype=np.int32)
    for i, g in enumerate(guides):
        g.matcher.fill_next_token_bitmask(mask, i)
    return mask
