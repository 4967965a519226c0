"""A GGUF file's SentencePiece vocabulary (tokenizer.ggml.model "llama": tokens, scores
and token types, as llama.cpp's converter stores Llama 2's, Mistral's, Gemma's and
Phi-3's) rebuilt as a tokenizer encodes and decodes as SentencePiece itself does, with
and without the prefix space, and streams the same text one token at a time. The
vocabulary is trained here by SentencePiece (BPE, byte fallback) and written into a GGUF
file by the `gguf` library, then read back.

Not covered, as they differ (the rebuilt tokenizer follows Hugging Face's SentencePiece-BPE
tokenizers there): a text that begins with a space or with a user-defined token, which
SentencePiece precedes with one more prefix space."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import sentencepiece

from protocol.text import IncrementalDetokenizer
from worker.models.config import CheckpointError
from worker.models.gguf_tokenizer import build_tokenizer

USER_SYMBOLS = ["<start_of_turn>", "<end_of_turn>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tokenizers split text into pieces; the pieces become ids.",
    "def main() -> int:\n    return 42  # the answer\n",
    "Numbers like 1234, 56.78 and 9e10 appear in text too.",
    "A worker runs the model, a gateway routes requests to workers.",
    "She sells sea shells by the sea shore, and the shells she sells are sea shells.",
    "Hello, world! Hello again, world? Hello for the third time.",
]
TEXTS = [
    "Hello world",
    "The lazy fox sells shells by the shore.",
    "spaces: three   inside, two at the end  ",
    "lines\nand\n\nmore lines\n",
    "tabs\tand accents: café, naïve, Ünïcödé",
    "outside the vocabulary: 🙂 漢字 ∑",
    "a turn: <start_of_turn>user hello<end_of_turn> done",
    "x",
    "",
]


def vocabulary(tmp_path: Path, prefix: bool) -> tuple[Any, dict[str, Any]]:
    """A SentencePiece BPE model trained on CORPUS, and the metadata of a GGUF file that
    holds its vocabulary as llama.cpp's converter writes one."""
    model_prefix = tmp_path / "spm"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4), model_prefix=str(model_prefix), vocab_size=320, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=prefix, split_digits=False,
        user_defined_symbols=USER_SYMBOLS, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )  # fmt: skip
    sp = sentencepiece.SentencePieceProcessor(model_file=f"{model_prefix}.model")
    pieces = range(sp.get_piece_size())
    types = [gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
             else gguf.TokenType.BYTE if sp.is_byte(i) else gguf.TokenType.UNUSED if sp.is_unused(i)
             else gguf.TokenType.USER_DEFINED if sp.id_to_piece(i) in USER_SYMBOLS else gguf.TokenType.NORMAL
             for i in pieces]  # fmt: skip
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in pieces])
    writer.add_token_scores([sp.get_score(i) for i in pieces])
    writer.add_token_types(types)
    writer.add_add_space_prefix(prefix)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(path)
    return sp, {name: field.contents() for name, field in reader.fields.items()}


@pytest.mark.parametrize("prefix", [True, False], ids=["space_prefix", "no_space_prefix"])
def test_sentencepiece_vocabulary_encodes_as_sentencepiece(tmp_path: Path, prefix: bool) -> None:
    sp, meta = vocabulary(tmp_path, prefix)
    tokenizer = build_tokenizer(meta, tmp_path / "vocab.gguf")
    byte_fallbacks = 0
    for text in TEXTS:
        want = sp.encode(text)
        got = tokenizer.encode(text, add_special_tokens=False).ids
        assert got == want, (text, [sp.id_to_piece(i) for i in want], [tokenizer.id_to_token(i) for i in got])
        assert tokenizer.decode(got, skip_special_tokens=False) == sp.decode(want), text
        streamed = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)  # as the gateway streams text
        for token in got:
            streamed.add([token])
        streamed.flush()
        assert streamed.text == sp.decode(want), text
        byte_fallbacks += sum(sp.is_byte(i) for i in want)
    assert byte_fallbacks > 0  # the texts reach the byte tokens


def test_sentencepiece_vocabulary_prepends_bos_when_the_file_says_so(tmp_path: Path) -> None:
    sp, meta = vocabulary(tmp_path, True)
    tokenizer = build_tokenizer(meta | {"tokenizer.ggml.add_bos_token": True}, tmp_path / "vocab.gguf")
    assert tokenizer.encode("Hello world").ids == [1, *sp.encode("Hello world")]


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("tokenizer.ggml.remove_extra_whitespaces", True, "remove_extra_whitespaces"),
        ("tokenizer.ggml.precompiled_charsmap", [1, 2, 3], "precompiled_charsmap"),
        ("tokenizer.ggml.model", "t5", "'t5'"),
    ],
)
def test_unsupported_vocabulary_settings_fail_naming_them(tmp_path: Path, field: str, value: Any, named: str) -> None:
    _, meta = vocabulary(tmp_path, True)
    with pytest.raises(CheckpointError, match=named):
        build_tokenizer(meta | {field: value}, tmp_path / "vocab.gguf")
