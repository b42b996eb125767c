"""Starting Ray and Serve for one machine, or joining a cluster, and stopping both.

Local (the default of ``rocs serve``): Ray starts in this process's session with the given CPUs,
no dashboard, and Serve's HTTP proxy bound to ``host:port``; it starts even where ``RAY_ADDRESS``
names a cluster (``ray.init()`` would join that cluster, and stopping would then shut down its
Serve). With a loopback ``host`` (the default, 127.0.0.1) every endpoint of that Ray listens on
127.0.0.1 only: its node address is 127.0.0.1, which Ray binds its GCS, raylet, agents and workers
to (``ray.init`` would otherwise swap 127.0.0.1 for the machine's address; Ray keeps a loopback
node only where it runs without clusters, which ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` asks for
while it starts), and each replica binds Serve's inter-deployment gRPC server there too
(:func:`loopback_replica`). Another ``host`` (``--host 0.0.0.0``) starts Ray on the machine's
address.

``address="auto"`` or ``"ray://..."`` joins a running cluster (``ray start --head`` ...) instead;
Serve then places replicas on its nodes.

Two fixed waits of Ray that a cold start on a loaded two-core machine can miss make a local start
try once more, with a warning: the raylet's 15 s for its agents, and Serve's 60 s for its HTTP
proxy (Ray stops and starts again).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import warnings
from typing import Any

import ray
from ray import serve

from . import ray_private

ray_private.check()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the caller binds it soon after)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_NO_CLUSTER = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps a loopback node address


@contextlib.contextmanager
def _loopback_node():
    """Ray started inside keeps 127.0.0.1 as its node address (its processes read the variable
    when they start; this process reads the constant when it resolves the address)."""
    ray_constants = ray_private.private_module("ray._private.ray_constants")
    saved_env, saved = os.environ.get(_NO_CLUSTER), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_NO_CLUSTER] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
        if saved_env is None:
            os.environ.pop(_NO_CLUSTER, None)
        else:
            os.environ[_NO_CLUSTER] = saved_env


def loopback_replica() -> None:
    """In a replica on a loopback node: Serve's inter-deployment gRPC server binds 127.0.0.1
    (Serve binds it to ``[::]``, every interface, whatever the node's address). Called when the
    replica's model loads, before Serve starts that server; elsewhere a no-op."""
    replica = ray_private.private_module("ray.serve._private.replica")
    bind = replica.add_port_to_grpc_server
    if getattr(bind, "loopback", False) or not ray.is_initialized():
        return
    if not is_loopback(ray.util.get_node_ip_address()):
        return

    def loopback_bind(server, address: str):
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address.removeprefix("[::]:")
        return bind(server, address)

    loopback_bind.loopback = True
    replica.add_port_to_grpc_server = loopback_bind


def _init(options: dict, loopback: bool) -> None:
    """``ray.init``; a local start whose raylet gave up on its agents (Ray waits a fixed 15 s for
    their ports, which a loaded machine can miss) is tried once more, with a warning."""
    for attempt in (1, 2):
        before = _children()
        try:
            with _loopback_node() if loopback else contextlib.nullcontext():
                ray.init(**options)
            return
        except Exception as err:  # Ray raises a bare Exception for it
            if attempt == 2 or options["address"] != "local" or "timed out" not in str(err):
                raise
            warnings.warn(
                f"rocs serve: Ray did not start ({err}; a loaded machine?); starting it again",
                RuntimeWarning,
                stacklevel=3,
            )
            ray.shutdown()
            # The failed start's processes (its GCS, monitors) are this process's children,
            # which ray.shutdown() does not know of: ended here.
            for pid in _children() - before:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def _children() -> set[int]:
    """This process's child processes (from /proc; none where there is no /proc)."""
    found, me = set(), os.getpid()
    entries = os.scandir("/proc") if os.path.isdir("/proc") else ()
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == me:
            found.add(int(entry.name))
    return found


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
    loopback = address is None and is_loopback(host)
    if address is None:
        options.update(address="local", num_cpus=num_cpus)
        if loopback:
            options["_node_ip_address"] = "127.0.0.1"
    else:
        options["address"] = address
    http = {"host": host, "port": port}
    if not ray.is_initialized():
        _init(options, loopback)
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
        _init(options, loopback)
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
    """Shut Serve and Ray down (this process's local Ray: every process it started exits).

    Each application is deleted first (its replicas finish their requests), then Ray shuts
    down, which ends Serve's controller and proxy with it. ``serve.shutdown()`` would instead
    have the controller kill itself inside its own ``graceful_shutdown`` call, which Ray reports
    on the console as a failed task ("killed by ray.kill").
    """
    try:
        for name in _applications():
            serve.delete(name)
    finally:
        ray.shutdown()


def _applications() -> list[str]:
    """The Serve applications of the Ray this process runs (none without Ray, Serve, or with a
    controller that died)."""
    if not ray.is_initialized():
        return []
    try:
        return list(serve.status().applications)
    except ray.exceptions.RayError:
        return []


def leave(name: str) -> None:
    """Remove the application ``name`` from a cluster this process joined, and disconnect."""
    try:
        if ray.is_initialized():
            serve.delete(name)
    finally:
        ray.shutdown()
