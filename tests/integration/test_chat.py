"""Chat with the default model through the service: the gateway renders the
messages with the template its worker sent, and the model answers Paris, through
the HTTP front (openai SDK), the ZeroMQ client, the CLI and a chat job."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from clients.client import Client
from clients.jobs import JobQueue, JobStatus
from tests.procs import CLIENT_OPTIONS, REPO, Proc, free_port, stack
from tests.worker.conftest import default_gguf

__all__ = ["default_gguf"]

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def service(default_gguf, redis_server, tmp_path_factory):
    port = free_port()
    with stack(default_gguf, redis_server.url, tmp_path_factory.mktemp("chat"), workers=0, gateways=0) as s:
        s.worker("--model-name", "SmolLM2-135M-Instruct")
        s.gateway("--http-port", str(port))
        s.gateways[0].wait_workers(1, timeout=120)
        s.http_url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
        yield s


def test_http_chat_answers_paris(service):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{service.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        r = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=24, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_client_chat_answers_paris(service):
    with Client([service.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
        out = client.chat(MESSAGES, max_tokens=24, temperature=0.0, timeout=120)
    assert "Paris" in out.text


def test_cli_chat_answers_paris(service):
    run = subprocess.run(
        [sys.executable, "-m", "clients.cli", "generate", QUESTION, "--chat", "--temperature", "0",
         "--max-tokens", "24", "--gateway", service.gateways[0].endpoint],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout


def test_chat_job_answers_paris(service, tmp_path):
    consumer = Proc("consumer", "clients.cli", ["jobs", "consume", "--gateway", service.gateways[0].endpoint,
                                                "--redis", service.redis_url], tmp_path)  # fmt: skip
    try:
        prompts = tmp_path / "batch.jsonl"
        body = {"model": "SmolLM2-135M-Instruct", "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
        prompts.write_text(json.dumps({"custom_id": "france", "method": "POST", "url": "/v1/chat/completions",
                                       "body": body}) + "\n")  # fmt: skip
        out = tmp_path / "results.jsonl"
        run = subprocess.run(
            [sys.executable, "-m", "clients.cli", "jobs", "run", str(prompts), "--out", str(out),
             "--redis", service.redis_url, "--timeout", "120", "--quiet"],
            cwd=REPO, capture_output=True, text=True, timeout=150,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        (result,) = [json.loads(line) for line in out.read_text().splitlines()]
        assert result["custom_id"] == "france" and result["line"] == 1
        assert result["status"] == JobStatus.DONE
        assert "Paris" in result["outputs"][0]["text"]
        with JobQueue(service.redis_url) as q:
            assert q.status(result["job_id"]) == JobStatus.DONE
    finally:
        consumer.stop()
