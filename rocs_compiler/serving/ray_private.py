"""Ray's private pieces that the serving layer reaches into, looked up in one place.

Ray offers no public switch for two things ``launch.py`` does on a loopback node:
``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` (Ray keeps 127.0.0.1 as the node's address)
and ``ray.serve._private.replica.add_port_to_grpc_server`` (a replica's gRPC server binds
127.0.0.1 instead of every interface). Private modules change between Ray releases without
notice, so the ``serve`` extra pins the releases they are tested with (:data:`TESTED_RAY`), and
a Ray without them is refused when ``launch`` is imported, in one line that names its version
and that range, before anything starts.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import ray

from ..errors import DependencyError

TESTED_RAY = ">=2.60,<2.61"  # the serve extra of pyproject.toml pins the same range
# Private module -> the attribute of it that launch.py reads or replaces.
NEEDED = {
    "ray._private.ray_constants": "ENABLE_RAY_CLUSTER",
    "ray.serve._private.replica": "add_port_to_grpc_server",
}


def private_module(name: str) -> ModuleType:
    """The private module ``name`` (a key of :data:`NEEDED`), checked to hold its attribute."""
    attribute = NEEDED[name]
    try:
        module = importlib.import_module(name)
    except ImportError:
        module = None
    if module is None or not hasattr(module, attribute):
        raise DependencyError(
            f"rocs serving needs Ray's private {name}.{attribute}, which ray "
            f"{ray.__version__} does not have; it is tested with ray[serve]{TESTED_RAY}: "
            f"pip install 'ray[serve]{TESTED_RAY}'"
        )
    return module


def check() -> None:
    """Refuse a Ray that lacks any of the private pieces the serving layer uses."""
    for name in NEEDED:
        private_module(name)
