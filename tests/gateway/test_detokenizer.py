"""Streamed text: exact across multi-byte characters, and nothing lost at the end."""

from __future__ import annotations

import pytest

from gateway.detokenizer import IncrementalDetokenizer
from tests.checkpoints import build_tokenizer

TEXT = "héllo wörld — ünïcode 🙂 and 漢字 text 🙂🙂"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_streamed_pieces_add_up_to_the_text(tokenizer) -> None:
    ids = tokenizer.encode(TEXT).ids
    assert len(ids) > len(TEXT) // 3  # byte-level pieces split the multi-byte characters
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in ids]
    assert detok.flush() == ""
    assert "".join(deltas) == TEXT == detok.text
    assert not any("\ufffd" in d for d in deltas)


def test_several_tokens_at_once_give_the_same_text(tokenizer) -> None:
    ids = tokenizer.encode(TEXT).ids
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(deltas) == TEXT


def test_a_character_cut_off_by_the_end_is_flushed_as_a_replacement(tokenizer) -> None:
    ids = tokenizer.encode("ok 🙂").ids
    detok = IncrementalDetokenizer(tokenizer)
    detok.add(ids[:-1])  # the emoji's last byte never comes
    assert detok.text == "ok "
    rest = detok.flush()
    assert rest and set(rest) == {"\ufffd"}
    assert detok.text == "ok " + rest
