"""The gateway keeps the tokenizers its workers send in Ready, one per model."""

from __future__ import annotations

import logging

import pytest

from gateway.tokenizer_store import Tokenizers
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


def test_a_different_tokenizer_replaces_it_with_a_warning(tokenizer_json, caplog):
    other = build_tokenizer()
    other.add_tokens(["<extra>"])
    store = Tokenizers()
    store.add("tiny", tokenizer_json)
    with caplog.at_level(logging.WARNING, logger="gateway.tokenizer_store"):
        store.add("tiny", other.to_str().encode())
    received = store.get("tiny")
    assert received is not None and received.token_to_id("<extra>") is not None
    assert "different tokenizers" in caplog.text


def test_a_broken_tokenizer_is_refused_and_the_old_one_kept(tokenizer_json, caplog):
    store = Tokenizers()
    store.add("tiny", tokenizer_json)
    first = store.get("tiny")
    with caplog.at_level(logging.ERROR, logger="gateway.tokenizer_store"):
        store.add("tiny", b'{"not": "a tokenizer"}')
        store.add("other", b"\xff\xfe")
    assert store.get("tiny") is first
    assert store.get("other") is None
    assert caplog.text.count("does not load") == 2
