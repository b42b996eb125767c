"""rocs_compiler: request-oriented compute sharing for recommendation models.

``rocs.compile(model, request_inputs=[...], example_inputs=..., example_kwargs=...)`` returns a
:class:`CompiledModel` whose request-only computation runs once per request and whose outputs
equal the original model's for every batch.

Importing the package is cheap and does not import torch: every public name is imported on
first use (PEP 562), so ``rocs --help`` and error messages do not pay for torch, sympy, Triton,
the renderers or the transforms. The ``rocs::`` custom ops are defined (their schemas, with
kernels that load on first use) as soon as torch is imported, before or after this package:
``import torch, rocs_compiler`` leaves a saved program loadable with ``torch.export.load`` or
``torch._inductor.aoti_load_package``, as importing any op library does.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from .errors import CompileError, InputError, OptionsError
from .ir.roles import Role
from .kernels.library import register_with_torch
from .options import Options

register_with_torch()

# public name -> the module (relative to this package) that defines it
_LAZY = {
    "compile": ".api",
    "backend": ".backend.door",
    "shared_call": ".backend.door",
    "export": ".export",
    "save": ".export",
    "load": ".export",
    "aoti_package": ".export",
    "export_onnx": ".export.onnx",
    "LoadedProgram": ".export",
    "JaggedProgram": ".export.jagged_program",
    "jagged_plan": ".export.jagged_program",
    "trusted_index": ".kernels.index_contract",
    "CompiledModel": ".runtime",
    "RequestCache": ".runtime.cache.request_cache",
    "RequestBalancer": ".distributed.balance",
    "RequestBatch": ".distributed.batch",
    "calibrate": ".runtime.program.calibration",
    "Calibration": ".runtime.program.calibration",
    "apply_glm": ".transforms",
    "apply_dca": ".transforms",
    "glm_from_zero_blocks": ".transforms",
    "DCABlock": ".transforms.layers",
    "GLMFactorizationMachine": ".transforms.layers",
    "GLMLinear": ".transforms.layers",
    "GLMLinearCompression": ".transforms.layers",
    "GroupLayerNorm": ".transforms.layers",
}

__all__ = [
    "compile", "Options", "CompileError", "InputError", "OptionsError", "Role", "CompiledModel",
    "backend", "shared_call", "export", "save", "load", "aoti_package", "export_onnx",
    "LoadedProgram", "apply_glm", "apply_dca", "GLMLinear", "GLMLinearCompression", "GroupLayerNorm",
    "GLMFactorizationMachine", "DCABlock", "trusted_index", "glm_from_zero_blocks", "RequestCache",
    "RequestBalancer", "RequestBatch", "calibrate", "Calibration", "JaggedProgram", "jagged_plan",
]  # fmt: skip
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """This package's module type: ``rocs.export`` and ``rocs.backend`` stay functions.

    Importing a submodule binds it on its parent, and two submodules share a name with the
    function they define (``rocs_compiler.export``, ``rocs_compiler.backend``). With lazy
    imports that binding can come after the function's, so it binds the function instead.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("export", "backend") and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
