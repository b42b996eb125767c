"""``rocs serve ARTIFACT``: a saved program behind Ray Serve, until Ctrl-C or SIGTERM.

::

    rocs serve ranker.pt2                                  # http://127.0.0.1:8000/score
    rocs serve ranker.pt2 --port 9000 --replicas 2 --max-batch-candidates 4096 --batch-wait-ms 2
    rocs serve ranker.pt2 --address auto                   # join a cluster (ray start --head)
    rocs serve ranker.pt2 --plain                          # the baseline: replicated rows

ARTIFACT is a ``torch.export`` program saved by ``rocs export`` / ``rocs.save`` /
``torch.export.save`` (a portable one, ``--portable``, included) or an AOTInductor package built
by ``rocs.aoti_package`` (``rocs export --aoti``); the two are told apart by their contents.
Without ``--address`` Ray starts here, on this machine only (every endpoint on 127.0.0.1 unless
``--host`` names another address), and stops with the command; with it, the command joins the
cluster, deploys there, and removes its application when stopped (the artifact's path must be
readable on every node). The protocol, the settings and the errors are described in
docs/serving.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

from ..errors import DependencyError, TargetError


def add_command(sub, common, positive) -> None:
    """The ``serve`` subcommand of ``rocs`` (``positive`` parses an integer >= 1)."""
    command = sub.add_parser(
        "serve",
        parents=[common],
        help="serve a saved program over HTTP (Ray Serve; the serve extra)",
        description="Serve ARTIFACT behind Ray Serve: requests are packed into shared-layout "
        "calls. POST /score, GET /info, GET /healthz (docs/serving.md).",
    )
    command.add_argument(
        "artifact",
        metavar="ARTIFACT",
        help="a program saved by rocs export (portable or not), or an AOTInductor package",
    )
    command.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    command.add_argument(
        "--host",
        default="127.0.0.1",
        help="HTTP address (default 127.0.0.1: Ray too listens on 127.0.0.1 only; 0.0.0.0 for "
        "all, Ray then on the machine's address)",
    )
    command.add_argument(
        "--replicas",
        type=positive,
        default=1,
        metavar="K",
        help="replicas of the model (default 1)",
    )
    command.add_argument(
        "--max-batch-candidates",
        type=positive,
        default=8192,
        metavar="C",
        help="candidates of all requests in one call, at most (default 8192); a larger request "
        "runs alone",
    )
    command.add_argument(
        "--max-batch-requests",
        type=positive,
        default=64,
        metavar="B",
        help="requests in one call, at most (default 64)",
    )
    command.add_argument(
        "--batch-wait-ms",
        type=float,
        default=2.0,
        metavar="W",
        help="how long a request waits for others to share its call (default 2)",
    )
    command.add_argument(
        "--max-queued",
        type=positive,
        default=256,
        metavar="Q",
        help="requests a replica holds before answering 503 (default 256)",
    )
    command.add_argument(
        "--threads",
        type=positive,
        metavar="T",
        help="torch threads per replica (and CPUs reserved for it)",
    )
    command.add_argument(
        "--address",
        metavar="ADDRESS",
        help="join a running Ray cluster ('auto', or ray://HOST:10001) instead of starting Ray",
    )
    command.add_argument(
        "--plain", action="store_true", help="serve the program on replicated rows (the baseline)"
    )
    command.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    artifact = os.path.abspath(args.artifact)
    if not os.path.isfile(artifact):
        raise TargetError(f"no such artifact: {args.artifact}")
    try:
        from ..serving import launch
        from ..serving.deployment import deployment
    except DependencyError as err:  # a Ray outside the tested range: the message says which
        raise TargetError(str(err)) from None
    except ImportError as err:
        raise TargetError(
            f"rocs serve needs Ray Serve ({err}): pip install 'rocs-compiler[serve]'"
        ) from None
    from ..serving.settings import ServeSettings

    settings = ServeSettings(
        max_batch_candidates=args.max_batch_candidates,
        max_batch_requests=args.max_batch_requests,
        batch_wait_ms=args.batch_wait_ms,
        max_queued=args.max_queued,
        threads=args.threads,
        plain=args.plain,
        replica_cpus=float(args.threads or 1),
    )
    stopping = threading.Event()

    def stop_on_signals() -> None:
        for number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(number, lambda *_: stopping.set())

    stop_on_signals()
    console = args.console
    name = "rocs"
    try:
        launch.start(args.port, args.host, address=args.address)
        stop_on_signals()  # after Ray's own handlers: stopping shuts Ray down in order
        if stopping.is_set():
            return 0
        console.note(f"deploying {args.artifact} ({args.replicas} replica(s))")
        launch.run(deployment(artifact, settings, replicas=args.replicas), name=name)
        url = f"http://{args.host}:{args.port}"
        print(
            f"rocs serve: {args.artifact} at {url}/score (GET {url}/info, {url}/healthz); "
            "Ctrl-C stops",
            flush=True,
        )
        while not stopping.wait(0.5):
            pass
        console.note("stopping")
    finally:
        if args.address is None:
            launch.stop()
        else:
            launch.leave(name)
    return 0
