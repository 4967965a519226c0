"""Token ids to text: exact across multi-byte characters, nothing lost at the end,
and stop strings cut the text without ever showing what they cut."""

from __future__ import annotations

import pytest

import protocol
from protocol import FinishReason
from protocol.text import IncrementalDetokenizer, OutputStream
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


SENTENCE = "Paris is the capital of France; Berlin is the capital of Germany."


def test_streamed_text_adds_up_to_the_whole_decode(tokenizer):
    ids = tokenizer.encode(SENTENCE + " héllo wörld 🙂").ids
    outs = _run(OutputStream(tokenizer, [], 1), _results(ids))
    assert "".join(o.text[0] for o in outs) == tokenizer.decode(ids)  # type: ignore[index]
    assert [t for o in outs for t in o.output_token_ids[0]] == ids
    assert outs[-1].is_final


@pytest.mark.parametrize("stop", ["capital of G", ";", "Germany."])
def test_stop_string_cuts_the_text_and_ends_the_request(tokenizer, stop):
    ids = tokenizer.encode(SENTENCE).ids
    stream = OutputStream(tokenizer, [stop, "never there"], 1)
    outs = _run(stream, _results(ids))
    # Text only ever grows, so equality also says no text past the stop was ever sent
    # (the part that might begin a stop string is held back until settled).
    text = "".join(o.text[0] for o in outs)  # type: ignore[index]
    assert text == SENTENCE[: SENTENCE.index(stop)]
    assert outs[-1].is_final
    assert outs[-1].finish_reasons == [FinishReason.STOP_WORDS]
    assert stream.finished


def test_results_after_the_end_are_dropped(tokenizer):
    ids = tokenizer.encode(SENTENCE).ids
    stream = OutputStream(tokenizer, [";"], 1)
    outs = _run(stream, _results(ids))
    assert sum(o.is_final for o in outs) == 1
    assert stream.apply(_results(ids)[-1]) is None


def test_without_a_tokenizer_tokens_pass_through(tokenizer):
    ids = [5, 6, 7]
    outs = _run(OutputStream(None, ["x"], 1), _results(ids))
    assert [o.output_token_ids[0] for o in outs] == [[5], [6], [7]]
    assert all(o.text is None for o in outs)
