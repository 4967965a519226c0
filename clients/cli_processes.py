"""`tokenwire worker` and `tokenwire gateway`: run one service process."""

from __future__ import annotations

import argparse

from clients.cli import Subparsers


def register(subparsers: Subparsers) -> None:
    from gateway.__main__ import add_arguments as gateway_arguments
    from worker.service.__main__ import add_arguments as worker_arguments

    worker = subparsers.add_parser(
        "worker", help="run a worker: one executor behind ZeroMQ, registered in Redis"
    )
    worker_arguments(worker)
    worker.set_defaults(handler=_run_worker)
    gateway = subparsers.add_parser("gateway", help="run a gateway: clients in, workers out")
    gateway_arguments(gateway)
    gateway.set_defaults(handler=_run_gateway)


def _run_worker(args: argparse.Namespace) -> int:
    from worker.service.__main__ import run

    return run(args)


def _run_gateway(args: argparse.Namespace) -> int:
    from gateway.__main__ import run

    return run(args)
