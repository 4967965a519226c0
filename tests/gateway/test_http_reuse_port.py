"""Several gateway processes behind one HTTP port (--http-reuse-port): the kernel spreads
new connections over them, each answers what it takes, and when one goes away the others
go on serving the port."""

from __future__ import annotations

import json
import re
import urllib.request

from tests.procs import free_port, stack

REQUESTS = 24


def _complete(port: int) -> dict:
    body = json.dumps({"model": "tiny-llama", "prompt": "hello", "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as answer:  # a new connection each time
        return json.loads(answer.read())


def _requests_ended(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    completed = r'^tokenwire_gateway_requests_total\{[^}]*outcome="completed"[^}]*\} (\S+)$'
    return sum(float(v) for v in re.findall(completed, text, re.MULTILINE))


def test_gateway_processes_share_one_http_port(service_model, redis_url, tmp_path):
    http, metrics = free_port(), [free_port(), free_port()]
    with stack(service_model, redis_url, tmp_path, workers=1, gateways=0) as s:
        for port in metrics:
            s.gateway("--http-port", str(http), "--http-reuse-port", "--metrics-port", str(port))
        for g in s.gateways:
            g.wait_workers(1)
        for _ in range(REQUESTS):
            assert _complete(http)["choices"][0]["finish_reason"] in ("length", "stop")
        served = [_requests_ended(port) for port in metrics]
        assert sum(served) == REQUESTS
        assert all(n > 0 for n in served), served  # both took connections
        s.gateways[0].stop()
        for _ in range(4):  # the port is the survivor's alone now
            assert _complete(http)["choices"]
        assert _requests_ended(metrics[1]) == served[1] + 4
