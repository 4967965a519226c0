"""The stop rules on their own: end token, stop words, max_tokens, the model's context."""

from __future__ import annotations

from worker.executor.sequence import Sequence
from worker.executor.stop_rules import finish_reason
from worker.executor.types import FinishReason, Request


def seq(prompt: list[int], generated: list[int], *, end_id: int = 2, max_tokens: int = 10,
        stop_words: list[list[int]] | None = None) -> Sequence:
    request = Request(input_token_ids=prompt, max_tokens=max_tokens, end_id=end_id)
    return Sequence(request_id=1, request=request, token_ids=prompt + generated, num_prompt_tokens=len(prompt),
                    end_id=end_id, stop_words=stop_words or [], bad_words=[], seed=0,
                    sampling_params=(0.0, 0.0, 1.0, 0.0))


def test_the_end_token_ends_a_sequence_at_its_position() -> None:
    s = seq([5, 6], [7, 2, 9])
    assert finish_reason(s, 3, 100) is FinishReason.NOT_FINISHED
    assert finish_reason(s, 4, 100) is FinishReason.END_ID


def test_a_stop_word_ends_it_only_within_the_generated_tokens() -> None:
    s = seq([8, 9], [4, 8, 9], stop_words=[[8, 9]])
    assert finish_reason(s, 2 + 1, 100) is FinishReason.NOT_FINISHED  # [8, 9] in the prompt does not count
    assert finish_reason(s, 2 + 3, 100) is FinishReason.STOP_WORDS


def test_max_tokens_and_the_context_end_it_with_length() -> None:
    assert finish_reason(seq([5], [6, 7, 8], max_tokens=3), 4, 100) is FinishReason.LENGTH
    assert finish_reason(seq([5], [6, 7, 8], max_tokens=3), 3, 100) is FinishReason.NOT_FINISHED
    assert finish_reason(seq([5, 5, 5], [6], max_tokens=10), 4, 4) is FinishReason.LENGTH


def test_the_end_token_wins_over_length() -> None:
    assert finish_reason(seq([5], [6, 2], max_tokens=2), 3, 100) is FinishReason.END_ID
