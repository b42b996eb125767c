"""Starting Ray and Serve for one machine, or joining a cluster, and stopping both.

Local (the default of ``rocs serve``): Ray starts in this process's session with the given CPUs,
no dashboard, its node address 127.0.0.1, and Serve's HTTP proxy bound to ``host:port``; it
starts even where ``RAY_ADDRESS`` names a cluster (``ray.init()`` would join that cluster, and
stopping would then shut down its Serve). ``address="auto"`` or ``"ray://..."`` joins a running
cluster (``ray start --head`` ...) instead; Serve then places replicas on its nodes. A local
start whose HTTP proxy Serve gave up on (its fixed 60 s, which a cold start on a loaded
two-core machine can miss) stops Ray and starts it once more, with a warning.
"""

from __future__ import annotations

import os
import socket
import warnings
from typing import Any

import ray
from ray import serve


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the caller binds it soon after)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def start(
    port: int = 8000,
    host: str = "127.0.0.1",
    *,
    address: str | None = None,
    num_cpus: int | None = None,
    pythonpath: list[str] | None = None,
) -> None:
    """Start (or join, with ``address``) Ray and start Serve's HTTP proxy on ``host:port``.

    ``pythonpath``: folders the replicas import from (a factory's module), prepended to their
    ``PYTHONPATH``; on a local start they inherit this process's environment.
    """
    if pythonpath:
        paths = [*pythonpath, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    if address is None:
        options.update(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1")
    else:
        options["address"] = address
    http = {"host": host, "port": port}
    if not ray.is_initialized():
        ray.init(**options)
    try:
        serve.start(http_options=http)
    except ray.exceptions.RayActorError:
        if address is not None:
            raise
        # Serve waits a fixed 60 s for its HTTP proxy and kills one that is not up by then,
        # which a cold start on a loaded two-core machine can miss: a fresh local Ray, once.
        warnings.warn(
            "rocs serve: Serve's HTTP proxy did not start within Serve's 60 s (a loaded "
            "machine?); starting Ray again",
            RuntimeWarning,
            stacklevel=2,
        )
        stop()
        ray.init(**options)
        serve.start(http_options=http)


def run(app: Any, name: str = "rocs", route_prefix: str = "/"):
    """Deploy ``app`` (``deployment.deployment(...)``) and wait until its replicas are up: its
    deployment handle (the Python path)."""
    return serve.run(app, name=name, route_prefix=route_prefix, blocking=False)


def run_many(apps: dict[str, Any]) -> dict[str, Any]:
    """Deploy several applications at once, each under ``/<name>``: their handles by name.
    Their replicas start together (one after another, each waits for its model to load)."""
    targets = [
        serve.RunTarget(app, name=name, route_prefix=f"/{name}") for name, app in apps.items()
    ]
    return dict(zip(apps, serve.run_many(targets)))


def stop() -> None:
    """Shut Serve and Ray down (this process's local Ray: every process it started exits)."""
    try:
        if ray.is_initialized():
            serve.shutdown()
    finally:
        ray.shutdown()


def leave(name: str) -> None:
    """Remove the application ``name`` from a cluster this process joined, and disconnect."""
    try:
        if ray.is_initialized():
            serve.delete(name)
    finally:
        ray.shutdown()
