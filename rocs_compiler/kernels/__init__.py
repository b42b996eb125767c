"""The ``rocs::`` custom ops: IKBO (in-kernel broadcast) ops and their kernels.

See :mod:`rocs_compiler.kernels.registry` for the table of ops. ``library`` registers every op's
schema with torch cheaply (``torch.ops.rocs.*`` resolve, a saved program loads); the records and
their kernels load on first use of a name below (PEP 562), which registers each op's FLOP
formula too.
"""

from __future__ import annotations

import importlib
from typing import Any

_REGISTRY_NAMES = (
    "ROCS_OPS", "ProgramError", "RocsOp", "format_program", "kernel_source", "parse_program",
    "reference_for", "rocs_op_for",
)  # fmt: skip

__all__ = list(_REGISTRY_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _REGISTRY_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".registry", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_REGISTRY_NAMES))
