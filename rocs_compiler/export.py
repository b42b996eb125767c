"""Exporting a compiled model: ``rocs.export``, ``rocs.save``, ``rocs.load``.

``rocs.export(cm)`` returns a ``torch.export.ExportedProgram`` of the rewritten graph in shared
layout. Its forward takes the model's tensor inputs by their original argument names (dict
inputs stay dicts) plus ``candidate_to_request``, with two dynamic sizes: ``R`` (rows of every
request input) and ``N`` (rows of every candidate input and of ``candidate_to_request``). It
returns the model's output structure. Requests with one candidate, R = 1 and N = 1 are all
accepted::

    program = rocs.export(cm)
    rocs.save(program, "model.pt2")
    # in the serving process
    import rocs_compiler as rocs                 # registers the rocs:: custom ops
    program = rocs.load("model.pt2")
    scores = program.module()(user_ids=u_R, item_ids=i_N, candidate_to_request=idx_N)

The graph may contain ``rocs::`` custom ops (the fused broadcast kernels). They are
``torch.library`` custom ops with fake kernels, so the program exports, serializes and compiles
with AOTInductor like any other; a process that *loads* the program must have them registered,
which ``import rocs_compiler`` does (``torch.export.load`` alone fails on an unknown operator).

AOTInductor packaging works on the same program (``torch._inductor.aoti_compile_and_package``;
see ``docs/tutorial.md``): :func:`aoti_package` wraps it.
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any, Mapping, Optional

import torch
from torch import fx, nn
from torch.export import Dim, ExportedProgram

# Registration of every rocs:: custom op, so that loading a saved program works after
# ``import rocs_compiler``.
from . import kernels as _kernels  # noqa: F401
from .errors import CompileError, InputError
from .ir.graph_meta import INDEX_NAME, PLACEMENT
from .formats.leaves import nest
from .ir.roles import Role

__all__ = ["aoti_package", "export", "load", "save"]


class _SharedLayoutProgram(nn.Module):
    """The rewritten graph behind a named, nested signature, returning the model's outputs."""

    def __init__(self, graph: fx.GraphModule, input_names: list[str], contract):
        super().__init__()
        self.rewritten = graph  # not "graph": that name is taken on the unlifted GraphModule
        self._input_names = list(input_names)
        self._contract = contract

    def _run(self, args: tuple, kwargs: dict):
        from torch.fx import traceback as fx_traceback

        from .formats.leaves import bind_inputs, named_leaves

        leaves = named_leaves(bind_inputs(inspect.signature(self.forward), args, kwargs))
        index = leaves.pop(INDEX_NAME)
        inputs = [leaves[name] for name in self._input_names]
        # Interpreted with node metadata preserved, so the exported nodes keep the source module
        # of the nodes they come from (reports and drawings of a saved program name them).
        with fx_traceback.preserve_node_meta():
            outputs = fx.Interpreter(self.rewritten).run(*inputs, index)
        return self._contract.outputs(list(outputs))


def _program_module(compiled) -> _SharedLayoutProgram:
    arguments = list(dict.fromkeys(name.split(".")[0] for name in compiled.contract.input_names))
    if INDEX_NAME in arguments:
        raise InputError(f"the model has an input named {INDEX_NAME!r}, which rocs reserves")
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    signature = inspect.Signature(
        [inspect.Parameter(a, kind) for a in ["self", *arguments, INDEX_NAME]]
    )

    def forward(self, *args, **kwargs):
        return self._run(args, kwargs)

    forward.__signature__ = signature
    cls = type("RocsSharedLayout", (_SharedLayoutProgram,), {"forward": forward})
    return cls(compiled.graph_module, compiled.contract.input_names, compiled.contract).eval()


def _nest(flat: Mapping[str, Any]) -> dict:
    """``{"features.user_age": x}`` -> ``{"features": {"user_age": x}}``."""
    return nest({tuple(name.split(".")): value for name, value in flat.items()})


def _synthetic_example(compiled, num_requests: int = 2, num_candidates: int = 3) -> dict:
    """Zero-valued shared-layout inputs with R != N (export needs only shapes and dtypes)."""
    placeholders = {n.name: n for n in compiled.graph_module.graph.nodes if n.op == "placeholder"}
    flat = {}
    for name in compiled.contract.input_names:
        node = placeholders[compiled.placeholder_of[name]]
        val = node.meta["val"]
        rows = {Role.REQUEST: num_requests, Role.CANDIDATE: num_candidates}.get(node.meta.get(PLACEMENT))
        shape = [rows if i == 0 and rows is not None else int(s) for i, s in enumerate(val.shape)]
        flat[name] = torch.zeros(shape, dtype=val.dtype, device=val.device)
    flat[INDEX_NAME] = torch.arange(num_candidates) % num_requests
    return flat


def _flat_example(compiled, example: Any) -> dict:
    from .formats.leaves import named_leaves

    if example is None:
        return _synthetic_example(compiled)
    if hasattr(example, "kwargs") and hasattr(example, "candidate_to_request"):
        example = {**example.kwargs, INDEX_NAME: example.candidate_to_request}
    if not isinstance(example, Mapping) or INDEX_NAME not in example:
        raise InputError(
            "example must be a shared-layout batch: a dict of inputs with 'candidate_to_request', "
            "or an object with .kwargs and .candidate_to_request (models_zoo.Batch)"
        )
    leaves = named_leaves(dict(example))
    missing = [n for n in compiled.contract.input_names if n not in leaves]
    if missing:
        raise InputError(f"example is missing input(s): {', '.join(missing)}")
    return {n: leaves[n] for n in [*compiled.contract.input_names, INDEX_NAME]}


def export(compiled, example: Optional[Any] = None) -> ExportedProgram:
    """A ``torch.export.ExportedProgram`` of ``compiled``'s rewritten graph in shared layout.

    Args:
        compiled: a :class:`~rocs_compiler.CompiledModel` from ``rocs.compile`` (for request
            column ranges, the program takes the packed input's column pieces as inputs; for
            KeyedJaggedTensor keys, every key's padded pieces).
        example: an optional shared-layout batch (dict with ``candidate_to_request`` or a
            ``models_zoo.Batch``); by default zero-valued inputs with R = 2, N = 3 are used,
            which is enough because the graph has no data-dependent control flow.
    """
    if getattr(compiled, "graph_module", None) is None:
        reason = getattr(compiled, "fallback_reason", None) or "not a rocs CompiledModel"
        raise CompileError(f"nothing to export: the model runs eagerly ({reason})")
    flat = _flat_example(compiled, example)
    module = _program_module(compiled)
    requests = set(compiled.contract.request_inputs)
    batched = compiled.contract.batched
    num_requests, num_candidates = Dim("R", min=1), Dim("N", min=1)
    dims = {INDEX_NAME: {0: num_candidates}}
    placeholders = {n.name: n for n in compiled.graph_module.graph.nodes if n.op == "placeholder"}
    for name in compiled.contract.input_names:
        val = placeholders[compiled.placeholder_of[name]].meta["val"]
        # Other dims that were symbolic at compile time (a padded length) stay dynamic.
        spec = {i: Dim.DYNAMIC for i, s in enumerate(val.shape) if i and not isinstance(s, int)}
        if batched.get(name):
            spec[0] = num_requests if name in requests else num_candidates
        dims[name] = spec or None
    example_kwargs = _nest(flat)
    with torch.no_grad():
        try:
            return torch.export.export(
                module, (), example_kwargs, dynamic_shapes=_nest(dims), strict=False
            )
        except Exception as err:
            raise CompileError(
                f"could not export the rewritten graph: {type(err).__name__}: {err}"
            ) from err


def save(program: ExportedProgram, path: str | os.PathLike) -> None:
    """``torch.export.save``; load it back with :func:`load` (or ``import rocs_compiler`` first)."""
    with warnings.catch_warnings():
        # torch warns about weights shared between the graph's constants; they are CPU tensors
        # saved once and loaded exactly, so the warning says nothing about this program.
        warnings.filterwarnings("ignore", message="No complete tensor found in the group")
        torch.export.save(program, path)


def load(path: str | os.PathLike) -> ExportedProgram:
    """``torch.export.load`` with the rocs:: custom ops registered (importing this module did)."""
    return torch.export.load(path)


def aoti_package(program: ExportedProgram, path: str | os.PathLike, **inductor_configs: Any) -> str:
    """Compile ``program`` ahead of time with AOTInductor into a ``.pt2`` package.

    Needs a C++ compiler. Load the package with ``torch._inductor.aoti_load_package(path)`` in a
    process that has imported ``rocs_compiler`` (the package calls the rocs:: ops' CPU kernels
    through the dispatcher when the graph contains them).
    """
    return torch._inductor.aoti_compile_and_package(
        program, package_path=os.fspath(path), inductor_configs=inductor_configs or None
    )
