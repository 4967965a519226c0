"""GuideLLM, a standard load generator, as a real client of the HTTP front: a short,
bounded streaming run against /v1/chat/completions (20 requests, 4 at a time) on a
real gateway and worker serving the tiny checkpoint. It fails when the tool reports
errored or incomplete requests, or no timings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.gateway.http_service import http_service

pytest.importorskip("guidellm", reason="guidellm is not installed (the `test` extra)")

MODEL = "tiny-llama-long"
REQUESTS = 20


@pytest.fixture(scope="module")
def service(long_model, redis_server, tmp_path_factory):
    with http_service(long_model, redis_server.url, tmp_path_factory.mktemp("load")) as s:
        yield s


def test_streaming_chat_run_has_no_errors(service, long_model, tmp_path):
    report = tmp_path / "benchmarks.json"
    guidellm = shutil.which("guidellm", path=os.path.dirname(sys.executable)) or "guidellm"
    run = subprocess.run(
        [guidellm, "run",
         "--backend", f"kind=openai_http,target={service.http_url},model={MODEL},"
                      "request_format=/v1/chat/completions,stream=true",
         "--profile", "kind=concurrent,streams=4",
         "--constraint", f"kind=max_requests,count={REQUESTS}",
         "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
         "--tokenizer", f"kind=huggingface_auto,model={long_model}",
         "--output", f"kind=json,path={report}",
         "--disable-console-interactive"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert totals["errored"] == 0 and totals["incomplete"] == 0, totals
    assert totals["successful"] == REQUESTS
    ttft = benchmark["metrics"]["time_to_first_token_ms"]["successful"]
    assert ttft["count"] == REQUESTS and ttft["mean"] > 0
