"""OpenAI's batch input lines for `tokenwire jobs run`: chat and completions bodies in
SamplingParams' names, /v1/responses lines as the chat they stand for, /v1/embeddings
lines as one input's embedding job, and clear refusals of what the job queue does not
serve, naming the field or the url."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from clients.cli import main as cli
from clients.cli_jobs import job_spec


def test_a_responses_line_runs_as_its_chat():
    line = {"custom_id": "r-1", "method": "POST", "url": "/v1/responses",
            "body": {"model": "m", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0,
                     "store": True, "input": [
                         {"role": "user", "content": "hi"},
                         {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
                         {"role": "user", "content": [{"type": "input_text", "text": "and "},
                                                      {"type": "input_text", "text": "now?"}]}]}}  # fmt: skip
    assert job_spec(line) == ("r-1", {
        "model": "m", "max_tokens": 7, "temperature": 0,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and now?"}]})  # fmt: skip
    text = {"url": "/v1/responses", "body": {"input": "hi"}}
    assert job_spec(text) == (None, {"messages": [{"role": "user", "content": "hi"}]})


def test_an_embeddings_line_is_one_inputs_embedding_job():
    line = {"custom_id": "e", "url": "/v1/embeddings", "body": {"input": ["hi there"], "model": "m",
                                                                "encoding_format": "float"}}  # fmt: skip
    assert job_spec(line) == ("e", {"prompt": "hi there", "embedding": {}, "model": "m"})
    tokens = {"url": "/v1/embeddings", "body": {"input": [1, 2, 3]}}
    assert job_spec(tokens) == (None, {"prompt": [1, 2, 3], "embedding": {}})


def test_a_chat_lines_tools_are_passed_on():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    line = {"url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}],
                                                     "tools": tools, "tool_choice": "required"}}  # fmt: skip
    assert job_spec(line)[1] == {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                 "tool_choice": "required"}  # fmt: skip


@pytest.mark.parametrize(("line", "match"), [
    ({"url": "/v1/embeddings", "body": {"input": ["a", "b"], "model": "m"}}, "embeds one input; this one has 2"),
    ({"url": "/v1/embeddings", "body": {"input": "a", "dimensions": 8}}, "not ['dimensions']"),
    ({"url": "/v1/embeddings", "body": {"input": "a", "encoding_format": "base64"}}, '"encoding_format" must be'),
    ({"url": "/v1/audio/speech", "body": {"input": "a"}}, "'/v1/audio/speech' is not served"),
    ({"url": "/v1/responses", "body": {"input": "hi", "tools": []}}, "not ['tools']"),
    ({"url": "/v1/responses", "body": {"max_output_tokens": 3}}, 'needs "input"'),
    ({"url": "/v1/responses", "body": {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}},
     "input_text or output_text"),
    ({"url": "/v1/responses", "body": {"input": []}}, "non-empty list"),
])  # fmt: skip
def test_what_the_queue_does_not_serve_is_refused_by_name(line: dict[str, Any], match: str):
    with pytest.raises(ValueError, match=match.replace("[", r"\[").replace("(", r"\(")):
        job_spec(line)


def test_jobs_run_refuses_a_bad_line_and_queues_nothing(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    prompts = tmp_path / "batch.jsonl"
    prompts.write_text('{"custom_id": "a", "url": "/v1/responses", "body": {"input": "fine"}}\n'
                       '{"custom_id": "b", "url": "/v1/embeddings", "body": {"input": ["x", "y"]}}\n')  # fmt: skip
    assert cli(["jobs", "run", str(prompts), "--out", str(tmp_path / "out.jsonl"), "--redis", redis_url]) == 1
    assert "batch.jsonl:2" in capsys.readouterr().err
    assert redis.Redis.from_url(redis_url).exists("tokenwire:jobs") == 0
