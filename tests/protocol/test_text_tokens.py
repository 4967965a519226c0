"""OutputStream.apply_tokens, the column path: the same text and the same ends as
`apply` on the Results the tokens stand for."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

import protocol
from protocol import FinishReason
from protocol.text import OutputStream
from tests.checkpoints import build_tokenizer

TEXT = "Paris is the capital of France; Berlin is the capital of Germany. héllo wörld 🙂"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _plain(tokens: list[int]) -> protocol.Result:
    return protocol.Result(is_final=False, output_token_ids=[tokens], finish_reasons=[FinishReason.NOT_FINISHED])


def _texts(outs: Sequence[str | protocol.Result | None]) -> list[str]:
    return [o if isinstance(o, str) else "".join(o.text or []) for o in outs if o is not None]


@pytest.mark.parametrize("stop", [[], ["capital of G"]])
def test_apply_tokens_gives_the_text_apply_gives(tokenizer, stop):
    ids = tokenizer.encode(TEXT).ids
    steps = [ids[i : i + 2] for i in range(0, len(ids), 2)]
    by_result = OutputStream(tokenizer, stop, 1)
    by_tokens = OutputStream(tokenizer, stop, 1)
    expected = [by_result.apply(_plain(step)) for step in steps]
    got = [by_tokens.apply_tokens(step) for step in steps]
    assert _texts(got) == _texts(expected)
    assert by_tokens.num_tokens == by_result.num_tokens
    assert by_tokens.finished == by_result.finished == bool(stop)
    if stop:
        assert "".join(_texts(got)) == TEXT[: TEXT.index(stop[0])]
        ended = [o for o in got if isinstance(o, protocol.Result) and o.is_final]
        assert len(ended) == 1 and ended[0].finish_reasons == [FinishReason.STOP_WORDS]
    else:  # past the first step, plain steps need no Result
        assert all(isinstance(o, str) for o in got[1:])


def test_apply_tokens_without_a_tokenizer_adds_no_text():
    stream = OutputStream(None, [], 1)
    outs = [stream.apply_tokens([5]), stream.apply_tokens([6, 7])]
    assert isinstance(outs[0], protocol.Result) and outs[0].text is None
    assert outs[1] == ""
    assert stream.num_tokens == 3


def test_apply_tokens_after_the_end_gives_nothing(tokenizer):
    stream = OutputStream(tokenizer, [], 1)
    final = protocol.Result(is_final=True, is_sequence_final=True, output_token_ids=[[5]],
                            finish_reasons=[FinishReason.LENGTH])  # fmt: skip
    assert stream.apply(final) is not None
    assert stream.apply_tokens([6]) is None
