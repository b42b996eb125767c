"""rocs_compiler: request-oriented compute sharing for recommendation models.

``rocs.compile(model, request_inputs=[...], example_inputs=..., example_kwargs=...)`` returns a
:class:`CompiledModel` whose request-only computation runs once per request and whose outputs
equal the original model's for every batch.
"""

from .api import compile
from .backend.door import backend, shared_call
from .export import aoti_package, export, load, save
from .errors import CompileError, InputError, OptionsError
from .kernels.index_contract import trusted_index
from .options import Options
from .ir.roles import Role
from .runtime import CompiledModel
from .transforms.layers import (
    DCABlock,
    GLMFactorizationMachine,
    GLMLinear,
    GLMLinearCompression,
    GroupLayerNorm,
)
from .transforms import apply_dca, apply_glm, glm_from_zero_blocks

__all__ = [
    "compile", "Options", "CompileError", "InputError", "OptionsError", "Role", "CompiledModel",
    "backend", "shared_call", "export", "save", "load", "aoti_package",
    "apply_glm", "apply_dca", "GLMLinear", "GLMLinearCompression", "GroupLayerNorm",
    "GLMFactorizationMachine", "DCABlock", "trusted_index", "glm_from_zero_blocks",
]
__version__ = "0.1.0"
