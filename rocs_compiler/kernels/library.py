"""The ``rocs::`` op library: each op's schema, registered with torch without its kernels.

``register()`` defines every ``torch.ops.rocs.<name>`` from the schema below, with a body, a fake
kernel and an autograd formula that look the op's :class:`~rocs_compiler.kernels.rocs_op.RocsOp`
record up by name on first use (``rocs_compiler.kernels.ROCS_OPS``). Defining the schemas costs a
few milliseconds; the records (their checks, CPU paths and the role rules they register) are
imported only when an op first runs or is traced. So ``import torch, rocs_compiler`` leaves a
saved program loadable with torch's own ``torch.export.load`` or ``aoti_load_package``, as
importing any op library does, without importing the compiler.

Identity: ``torch.ops.rocs.<name>(*args) == ROCS_OPS[name].checked_run(*args)``, the same body
:func:`~rocs_compiler.kernels.rocs_op.define` promised when it registered the op itself.

This module imports neither torch nor the records at import time: ``rocs_compiler/__init__.py``
imports it in every process (``rocs --help`` included) to call :func:`register` when torch is or
becomes imported (:func:`register_with_torch`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading
from typing import Any

from .op_schemas import SCHEMAS

_LOCK = threading.Lock()
_REGISTERED = False


def _record(name: str) -> Any:
    # By name and at call time: the records import this module (rocs_op.define calls register).
    return importlib.import_module("rocs_compiler.kernels").ROCS_OPS[name]


def _rocs_op_module() -> Any:
    return importlib.import_module("rocs_compiler.kernels.rocs_op")


def _define(name: str) -> None:
    import torch

    def body(*args: Any) -> Any:
        return _record(name).checked_run(*args)

    def fake(*args: Any) -> Any:
        return _record(name).fake(*args)

    def backward(ctx: Any, grad: Any) -> tuple:
        return _rocs_op_module().gradients(_record(name), ctx, ctx.needs_input_grad, grad)

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        _rocs_op_module().save_arguments(ctx, inputs, output)

    qualified = f"rocs::{name}"
    op = torch.library.custom_op(qualified, body, mutates_args=(), schema=SCHEMAS[name])
    op.register_fake(fake)
    torch.library.register_autograd(qualified, backward, setup_context=setup_context)


def register() -> None:
    """Define every ``torch.ops.rocs.<name>`` (once per process; imports torch)."""
    global _REGISTERED
    with _LOCK:
        if _REGISTERED:
            return
        for name in SCHEMAS:
            _define(name)
        _REGISTERED = True


class _AfterTorch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torch`` the way the rest of ``sys.meta_path`` does, and calls :func:`register`
    once torch's module has run (then leaves ``sys.meta_path``)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        try:
            register()
        except Exception as err:  # never let this package break ``import torch``
            import warnings

            warnings.warn(f"rocs: could not register the rocs:: ops with torch: {err}")


def register_with_torch() -> None:
    """:func:`register` now if torch is imported, else as soon as it is (so the order of
    ``import torch`` and ``import rocs_compiler`` does not matter, and a process that never
    imports torch, such as ``rocs --help``, never pays for it)."""
    if "torch" in sys.modules:
        register()
    elif not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())
