"""The gateway keeps the tokenizers its workers send in Ready, one per model."""

from __future__ import annotations

import hashlib
import logging

import pytest

from gateway.tokenizer_store import PromptError, Tokenizers
from tests.checkpoints import build_tokenizer

TEXT = "The quick brown fox"


@pytest.fixture(scope="module")
def tokenizer_json() -> bytes:
    return bytes(build_tokenizer().to_str().encode())


def test_a_sent_tokenizer_encodes_like_the_original(tokenizer_json):
    store = Tokenizers()
    assert store.get("tiny") is None
    store.add("tiny", tokenizer_json)
    received = store.get("tiny")
    assert received is not None
    assert received.encode(TEXT).ids == build_tokenizer().encode(TEXT).ids


def test_the_same_tokenizer_again_is_not_parsed_again(tokenizer_json):
    store = Tokenizers()
    store.add("tiny", tokenizer_json)
    first = store.get("tiny")
    store.add("tiny", tokenizer_json)  # a second worker of the same model
    assert store.get("tiny") is first


def test_a_different_tokenizer_is_refused(tokenizer_json, caplog):
    """A worker sending another tokenizer does not replace the one every request for
    that model is tokenized with."""
    other = build_tokenizer()
    other.add_tokens(["<extra>"])
    store = Tokenizers()
    assert store.add("tiny", tokenizer_json)
    first = store.get("tiny")
    with caplog.at_level(logging.ERROR, logger="gateway.tokenizer_store"):
        assert not store.add("tiny", other.to_str().encode(), "worker w2")
    assert store.get("tiny") is first
    assert "worker w2 sent a tokenizer for tiny" in caplog.text and "refused" in caplog.text


def test_a_pinned_hash_refuses_any_other_tokenizer(tokenizer_json):
    other = build_tokenizer()
    other.add_tokens(["<extra>"])
    pinned = hashlib.sha256(tokenizer_json).hexdigest()
    store = Tokenizers({"tiny": pinned.upper()})
    assert not store.add("tiny", other.to_str().encode())
    assert store.get("tiny") is None
    assert store.add("tiny", tokenizer_json)
    assert store.get("tiny") is not None


def test_a_broken_tokenizer_is_refused_and_the_old_one_kept(tokenizer_json, caplog):
    store = Tokenizers()
    store.add("tiny", tokenizer_json)
    first = store.get("tiny")
    with caplog.at_level(logging.ERROR, logger="gateway.tokenizer_store"):
        store.add("tiny", b'{"not": "a tokenizer"}')
        store.add("other", b"\xff\xfe")
    assert store.get("tiny") is first
    assert store.get("other") is None
    assert "differs from the one held" in caplog.text  # for tiny: one is held already
    assert caplog.text.count("does not load") == 1


def test_prompt_ids_of_text_and_chats_and_what_is_refused(tokenizer_json: bytes) -> None:
    store = Tokenizers()
    assert store.add("m", tokenizer_json)
    original = build_tokenizer()
    assert store.prompt_ids("m", TEXT, None, 512) == original.encode(TEXT).ids
    with pytest.raises(PromptError, match="longer than any text the model's context of 4 tokens can hold"):
        store.prompt_ids("m", "x" * 1000, None, 4)  # refused without encoding it
    with pytest.raises(PromptError, match="encodes to no tokens"):
        store.prompt_ids("m", "", None, 512)
    with pytest.raises(PromptError, match="no tokenizer for model 'other'"):
        store.prompt_ids("other", TEXT, None, 512)
