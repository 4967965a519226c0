"""`tokenwire up`: the whole stack on this machine, for `make run`.

Redis (started here only if nothing answers at --redis), one worker and one
gateway as child processes, a streamed demo generation through the gateway,
then serving until Ctrl-C, which stops every child this command started.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from clients.cli import Subparsers
from ops.process import stop_children

DEMO_PROMPT = "In one sentence, what is a message queue?"


def register(subparsers: Subparsers) -> None:
    up = subparsers.add_parser(
        "up", help="Redis (if needed) + a worker + a gateway here, a streamed demo, serve until Ctrl-C"
    )
    up.add_argument("--model", default="SmolLM2-135M-Instruct", help="checkpoint or the default model's name")
    up.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    up.add_argument("--gateway-bind", default="tcp://127.0.0.1:5550")
    up.add_argument("--worker-bind", default="tcp://127.0.0.1:5600")
    up.add_argument("--backend", default="auto", choices=["auto", "numpy", "torch"])
    up.add_argument("--prompt", default=DEMO_PROMPT, help="the demo prompt (chat template applied)")
    up.add_argument("--max-tokens", type=int, default=48)
    up.add_argument("--no-demo", action="store_true")
    up.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the worker")
    up.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        if not _redis_answers(args.redis):
            children.append(("redis", _start_redis(args.redis)))
        else:
            print(f"using the Redis at {args.redis}")
        from worker.models.default_model import resolve_model

        path = Path(args.model) if Path(args.model).exists() else resolve_model(args.model)
        py = sys.executable
        children.append(
            (
                "worker",
                subprocess.Popen(
                    [
                        py,
                        "-m",
                        "worker.service",
                        "--model",
                        str(path),
                        "--bind",
                        args.worker_bind,
                        "--redis",
                        args.redis,
                        "--backend",
                        args.backend,
                    ]
                ),
            )
        )
        children.append(
            (
                "gateway",
                subprocess.Popen(
                    [
                        py,
                        "-m",
                        "gateway",
                        "--bind",
                        args.gateway_bind,
                        "--redis",
                        args.redis,
                    ]
                ),
            )
        )
        if not _wait_for_worker(args.redis, children, args.startup_timeout):
            return 1
        print(
            f"\ntokenwire is up: gateway {args.gateway_bind}, worker {args.worker_bind}, Redis {args.redis}"
        )
        if not args.no_demo:
            _demo(args.gateway_bind, _chat_prompt(path, args.prompt), args.max_tokens)
        print('serving; try `tokenwire generate "Hello" --stream` or `tokenwire stats`. Ctrl-C stops.')
        while True:
            for name, proc in children:
                if proc.poll() is not None:
                    print(f"error: the {name} exited with status {proc.returncode}", file=sys.stderr)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nstopping")
        return 0
    finally:
        stop_children([proc for _, proc in children])


def _redis_answers(url: str) -> bool:
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def _start_redis(url: str) -> subprocess.Popen[bytes]:
    u = urlparse(url)
    if u.hostname not in ("127.0.0.1", "localhost"):
        raise SystemExit(f"error: nothing answers at {url}, and only a local Redis can be started here")
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(
            "error: no Redis answers and redis-server is not on PATH (apt-get install redis-server)"
        )
    port = u.port or 6379
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not _redis_answers(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"error: redis-server did not start on port {port}")
        time.sleep(0.05)
    print(f"started redis-server on port {port} (no persistence)")
    return proc


def _wait_for_worker(url: str, children: list[tuple[str, subprocess.Popen[bytes]]], timeout: float) -> bool:
    import redis

    import protocol

    r = redis.Redis.from_url(url, socket_timeout=2)
    keys = protocol.Keys()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in children:
            if proc.poll() is not None:
                print(
                    f"error: the {name} exited with status {proc.returncode} while starting", file=sys.stderr
                )
                return False
        if any(r.exists(keys.worker(w.decode())) for w in r.zrange(keys.workers(), 0, -1)):  # type: ignore[union-attr]
            return True
        time.sleep(0.2)
    print(f"error: no worker registered within {timeout:g} s", file=sys.stderr)
    return False


def _chat_prompt(path: Path, prompt: str) -> str:
    """The prompt in the model's chat template, when it has one."""
    from worker.models.loader import load_model

    template = load_model(path, load_weights=False).chat_template
    if not template:
        return prompt
    import jinja2

    env = jinja2.Environment(autoescape=False)
    return env.from_string(template).render(
        messages=[{"role": "user", "content": prompt}], add_generation_prompt=True, bos_token="", eos_token=""
    )


def _demo(gateway: str, prompt: str, max_tokens: int) -> None:
    from clients.client import Client

    print(f"\ndemo, streamed through the gateway (max {max_tokens} tokens):\n")
    start = time.perf_counter()
    first = None
    with Client([gateway]) as client:
        future = client.stream(prompt, max_tokens=max_tokens, temperature=0.0)
        for chunk in future:
            if first is None:
                first = time.perf_counter() - start
            print(chunk.text, end="", flush=True)
        result = future.result()
    total = time.perf_counter() - start
    ttft_ms = (first or 0.0) * 1e3
    print(f"\n\n[{len(result.token_ids)} tokens in {total:.2f} s, first token after {ttft_ms:.0f} ms]\n")


