"""`tokenwire up`: the whole stack on this machine, for `make run`.

Redis (started here only if nothing answers at --redis), one worker, one gateway
with its OpenAI-compatible HTTP front (--http-port, 8000 by default) and one job
consumer, as child processes; "up" once every one of them listens; a streamed
chat demo through the gateway; then serving until Ctrl-C (or SIGTERM, SIGHUP), which
stops every child this command started, Redis last (the others deregister there).

The children log to files under --log-dir, so the demo's text is not mixed with
their log lines; a child that exits has its last log line printed (its one-line
start-up error).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO
from urllib.parse import urlparse

from clients.cli import Subparsers
from ops.process import LAUNCHER_ENV, stop_children
from ops.secrets import REDIS_URL_ENV, add_redis_password_option, redact, redis_url

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"

DEMO_PROMPT = "In one sentence, what is a message queue?"


def register(subparsers: Subparsers) -> None:
    up = subparsers.add_parser(
        "up", help="Redis (if needed) + a worker + a gateway (ZeroMQ and HTTP) + a job consumer here, a demo, serve"
    )
    up.add_argument("--model", default="SmolLM2-135M-Instruct", help="checkpoint or the default model's name")
    up.add_argument("--redis", default=DEFAULT_REDIS,
                    help=f"Redis URL (default {DEFAULT_REDIS}, or ${REDIS_URL_ENV}); keep a password out of it "
                    "and in --redis-password-file: the children get the URL in their environment, never in argv")
    add_redis_password_option(up)
    up.add_argument("--gateway-bind", default="tcp://127.0.0.1:5550")
    up.add_argument("--worker-bind", default="tcp://127.0.0.1:5600")
    up.add_argument("--http-port", type=int, default=8000, help="the gateway's OpenAI-compatible API (0: off)")
    up.add_argument("--http-host", default="127.0.0.1")
    up.add_argument("--no-consumer", action="store_true", help="start no job consumer")
    up.add_argument("--backend", default="auto", choices=["auto", "numpy", "torch"])
    up.add_argument("--prompt", default=DEMO_PROMPT, help="the demo's question (a chat, in the model's template)")
    up.add_argument("--max-tokens", type=int, default=48)
    up.add_argument("--no-demo", action="store_true")
    up.add_argument("--log-dir", type=Path, default=None, help="where the children log (default: a temporary dir)")
    up.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the worker")
    up.set_defaults(handler=run)


class _Children:
    """The processes started here, each logging to its own file and saying when it
    listens as under systemd (READY=1 on the notify socket this command holds).

    A thread reads that socket for as long as the children run, as systemd would: they
    keep sending (STATUS on every tick, WATCHDOG=1), and a datagram socket queues only
    a few messages (net.unix.max_dgram_qlen, 10 by default), after which what they
    send is dropped."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir = log_dir
        self.env = env  # beside this process's own: what the children are given (the Redis URL)
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._logs: list[IO[bytes]] = []
        self._notify_dir = Path(tempfile.mkdtemp(prefix="tw-up-"))  # AF_UNIX paths are short: not under log_dir
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self._notify_dir / "notify"))
        self.notify.settimeout(0.2)  # how long the reader takes to notice stop()
        self.ready_pids: set[int] = set()
        self._stopping = threading.Event()
        self._reader = threading.Thread(target=self._read_notifications, name="notify-reader", daemon=True)
        self._reader.start()

    def _read_notifications(self) -> None:
        while not self._stopping.is_set():
            try:
                lines = self.notify.recv(4096).decode(errors="replace").splitlines()
            except TimeoutError:
                continue
            fields = dict(line.split("=", 1) for line in lines if "=" in line)
            if fields.get("READY") == "1" and fields.get("MAINPID", "").isdigit():
                self.ready_pids.add(int(fields["MAINPID"]))

    def start(self, name: str, args: list[str]) -> None:
        log = (self.log_dir / f"{name}.log").open("wb")
        self._logs.append(log)
        # The launcher's pid: each child gets SIGTERM when this process ends, kill -9 included
        # (ops.process.stop_with_launcher). A redis-server started here does not: it stays.
        env = {**os.environ, **self.env, "NOTIFY_SOCKET": str(self._notify_dir / "notify"),
               LAUNCHER_ENV: str(os.getpid())}
        self.procs.append((name, subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)))

    def all_ready(self) -> bool:
        return all(proc.pid in self.ready_pids for _, proc in self.procs)

    def exited(self) -> str | None:
        """What went wrong, if a child has exited: its name, status and last log line."""
        for name, proc in self.procs:
            if proc.poll() is not None:
                lines = (self.log_dir / f"{name}.log").read_text(errors="replace").strip().splitlines()
                last = lines[-1] if lines else "(no output)"
                return f"the {name} exited with status {proc.returncode}: {last}"
        return None

    def stop(self, redis: subprocess.Popen[bytes] | None) -> None:
        stop_children([proc for _, proc in self.procs])
        if redis is not None:  # last: the others deregister there as they stop
            stop_children([redis])
        for log in self._logs:
            log.close()
        self._stopping.set()
        self._reader.join()
        self.notify.close()
        shutil.rmtree(self._notify_dir, ignore_errors=True)


def _stop_like_ctrl_c(signum: int, frame: object) -> None:
    """SIGTERM (kill, a supervisor) and SIGHUP (the terminal closed) stop everything
    as Ctrl-C does: left to their default, this process would end alone and leave its
    children serving, holding their ports (and a GPU)."""
    signal.signal(signum, signal.SIG_IGN)  # a second one must not cut the stopping short
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # under nohup, a closed terminal stops nothing
            signal.signal(sig, _stop_like_ctrl_c)
    redis_proc = None
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="tokenwire-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        args.redis = redis_url(args.redis, DEFAULT_REDIS, args.redis_password_file)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    # In the environment, not argv: `ps` shows every user a process's argv, and the URL may hold a password.
    children = _Children(log_dir, {REDIS_URL_ENV: args.redis})
    try:
        if not _redis_answers(args.redis):
            redis_proc = _start_redis(args.redis)
        else:
            print(f"using the Redis at {redact(args.redis)}")
        from worker.models.config import CheckpointError
        from worker.models.default_model import resolve_model

        try:
            path = Path(args.model) if Path(args.model).exists() else resolve_model(args.model)
        except (CheckpointError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        py = sys.executable
        children.start("worker", [py, "-m", "worker.service", "--model", str(path), "--bind", args.worker_bind,
                                  "--backend", args.backend])  # fmt: skip
        http = ["--http-port", str(args.http_port), "--http-host", args.http_host] if args.http_port else []
        children.start("gateway", [py, "-m", "gateway", "--bind", args.gateway_bind, *http])
        if not args.no_consumer:
            children.start("consumer", [py, "-m", "clients.cli", "jobs", "consume", "--gateway", args.gateway_bind])
        print(f"starting (logs in {log_dir})", flush=True)
        problem = _wait_until_up(args, children)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 1
        http_url = f"http://{args.http_host}:{args.http_port}" if args.http_port else None
        print(f"\ntokenwire is up: gateway {args.gateway_bind}" + (f" and {http_url}/v1" if http_url else "")
              + f", worker {args.worker_bind}, Redis {redact(args.redis)}"
              + ("" if args.no_consumer else ", one job consumer"))  # fmt: skip
        if not args.no_demo:
            _demo(args.gateway_bind, args.prompt, args.max_tokens)
        print('serving; try `tokenwire generate "Hello" --chat --stream`'
              + (f" or `curl {http_url}/v1/models`" if http_url else "") + ". Ctrl-C stops.", flush=True)  # fmt: skip
        while True:
            problem = children.exited()
            if problem:
                print(f"error: {problem}", file=sys.stderr)
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nstopping", flush=True)
        return 0
    finally:
        children.stop(redis_proc)


def _wait_until_up(args: argparse.Namespace, children: _Children) -> str | None:
    """None once every child listens (each said READY, and the gateway has a worker
    ready: its HTTP front answers /health); else what went wrong."""
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        problem = children.exited()
        if problem:
            return problem
        if children.all_ready() and (_health(args) if args.http_port else _gateway_answers(args.gateway_bind)):
            return None
        time.sleep(0.2)
    return f"not up within {args.startup_timeout:g} s (see the logs in {children.log_dir})"


def _health(args: argparse.Namespace) -> bool:
    """The HTTP front answers 200 only with Redis reached and a worker ready."""
    try:
        with urllib.request.urlopen(f"http://{args.http_host}:{args.http_port}/health", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _gateway_answers(endpoint: str) -> bool:
    u = urlparse(endpoint.replace("tcp://", "http://", 1))
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 5550), timeout=1):
            return True
    except OSError:
        return False


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


def _demo(gateway: str, prompt: str, max_tokens: int) -> None:
    from clients.client import Client

    print(f"\ndemo, a chat streamed through the gateway (max {max_tokens} tokens):\n\n> {prompt}\n")
    start = time.perf_counter()
    first = None
    with Client([gateway]) as client:
        messages = [{"role": "user", "content": prompt}]
        future = client.submit(None, messages=messages, streaming=True, max_tokens=max_tokens, temperature=0.0)
        for chunk in future:
            if first is None:
                first = time.perf_counter() - start
            print(chunk.text, end="", flush=True)
        result = future.result()
    total = time.perf_counter() - start
    ttft_ms = (first or 0.0) * 1e3
    print(f"\n\n[{len(result.token_ids)} tokens in {total:.2f} s, first token after {ttft_ms:.0f} ms]\n")


