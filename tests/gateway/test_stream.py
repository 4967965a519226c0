"""The gateway's per-request output stream: incremental text and stop strings."""

from __future__ import annotations

import pytest

import protocol
from gateway.stream import OutputStream
from protocol import FinishReason
from tests.checkpoints import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _results(ids: list[int], final_reason: FinishReason = FinishReason.LENGTH) -> list[protocol.Result]:
    return [
        protocol.Result(
            is_final=i == len(ids) - 1,
            is_sequence_final=i == len(ids) - 1,
            output_token_ids=[[t]],
            finish_reasons=[final_reason if i == len(ids) - 1 else FinishReason.NOT_FINISHED],
        )
        for i, t in enumerate(ids)
    ]


def _run(stream: OutputStream, results: list[protocol.Result]) -> list[protocol.Result]:
    return [out for r in results if (out := stream.apply(r)) is not None]


TEXT = "Paris is the capital of France; Berlin is the capital of Germany."


def test_streamed_text_adds_up_to_the_whole_decode(tokenizer):
    ids = tokenizer.encode(TEXT + " héllo wörld 🙂").ids
    outs = _run(OutputStream(tokenizer, [], 1), _results(ids))
    assert "".join(o.text[0] for o in outs) == tokenizer.decode(ids)  # type: ignore[index]
    assert [t for o in outs for t in o.output_token_ids[0]] == ids
    assert outs[-1].is_final


@pytest.mark.parametrize("stop", ["capital of G", ";", "Germany."])
def test_stop_string_cuts_the_text_and_ends_the_request(tokenizer, stop):
    ids = tokenizer.encode(TEXT).ids
    stream = OutputStream(tokenizer, [stop, "never there"], 1)
    outs = _run(stream, _results(ids))
    # Text only ever grows, so equality also says no text past the stop was ever sent
    # (the part that might begin a stop string is held back until settled).
    text = "".join(o.text[0] for o in outs)  # type: ignore[index]
    assert text == TEXT[: TEXT.index(stop)]
    assert outs[-1].is_final
    assert outs[-1].finish_reasons == [FinishReason.STOP_WORDS]
    assert stream.finished


def test_results_after_the_end_are_dropped(tokenizer):
    ids = tokenizer.encode(TEXT).ids
    stream = OutputStream(tokenizer, [";"], 1)
    outs = _run(stream, _results(ids))
    assert sum(o.is_final for o in outs) == 1
    assert stream.apply(_results(ids)[-1]) is None


def test_without_a_tokenizer_tokens_pass_through(tokenizer):
    ids = [5, 6, 7]
    outs = _run(OutputStream(None, ["x"], 1), _results(ids))
    assert [o.output_token_ids[0] for o in outs] == [[5], [6], [7]]
    assert all(o.text is None for o in outs)
