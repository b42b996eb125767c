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
    import rocs_compiler as rocs
    program = rocs.load("model.pt2")             # registers the rocs:: custom ops, then loads
    scores = program(u_R, i_N, idx_N)            # the model's argument order, then the index
    scores = program(user_ids=u_R, item_ids=i_N, candidate_to_request=idx_N)
    program.program                              # the torch.export.ExportedProgram

The graph may contain ``rocs::`` custom ops (the fused broadcast kernels). They are
``torch.library`` custom ops with fake kernels, so the program exports, serializes and compiles
with AOTInductor like any other; a process that *loads* the program must have them registered,
which ``import rocs_compiler`` does (``torch.export.load`` and
``torch._inductor.aoti_load_package`` without it fail on an unknown operator).

AOTInductor packaging works on the same program (``torch._inductor.aoti_compile_and_package``;
see ``docs/tutorial.md``): :func:`aoti_package` wraps it. ``export(cm, portable=True)`` replaces
every ``rocs::`` op by plain torch (``portable.py``), for processes without this package: C++
through AOTInductor, ONNX Runtime (``onnx.py``). Every program checks its inputs inside its graph
as the compiled model does (``input_checks.py``); see ``docs/deploy.md``.
"""

from __future__ import annotations

import inspect
import json
import os
import warnings
from typing import Any, Mapping, Optional

import torch
from torch import fx, nn
from torch.export import Dim, ExportedProgram
from torch.utils import _pytree as pytree

from ..kernels.library import register as _register_rocs_ops
from ..errors import CompileError, InputError
from ..ir.graph_meta import INDEX_NAME, PLACEMENT
from ..formats.leaves import named_leaves, nest
from .aoti_checks import input_checks_by_default
from .portable import PortableInterpreter, rocs_ops_in
from .size_names import with_size_names
from ..runtime.program.eager_checks import eager_check
from ..runtime.call.jagged import plan_of
from ..runtime.modes.new_sizes import make_dynamic
from .jagged_program import JAGGED_META, JaggedProgram, plan_of_program, read_plan
from .input_checks import (
    TRACED_EAGER_CHECKS,
    as_input_error,
    check_loaded_index,
    check_shared_call,
    jagged_pieces,
)
from ..ir.roles import Role

__all__ = [
    "INPUTS_METADATA", "JAGGED_META", "JaggedProgram", "LoadedProgram", "aoti_package", "export",
    "input_signature", "load", "rocs_ops_in", "save",
]

JAGGED_FILE = "rocs.jagged.json"  # the jagged plan's entry in a saved program's archive


class _SharedLayoutProgram(nn.Module):
    """The rewritten graph behind a named, nested signature, returning the model's outputs."""

    def __init__(
        self, graph: fx.GraphModule, input_names: list[str], contract, portable: bool, caps=()
    ):
        super().__init__()
        self._interpreter = checking(PortableInterpreter if portable else fx.Interpreter)
        self.rewritten = graph  # not "graph": that name is taken on the unlifted GraphModule
        self._input_names = list(input_names)
        self._contract = contract
        requests = [n for n in contract.batched_inputs if n in set(contract.request_inputs)]
        self._request_rows_from = requests[0] if requests else None
        self._jagged = jagged_pieces(self._input_names)
        self._caps = [(name, dim, cap) for name, dim, _, cap in caps]

    def _run(self, args: tuple, kwargs: dict):
        from torch.fx import traceback as fx_traceback

        from ..formats.leaves import bind_inputs, named_leaves

        leaves = named_leaves(bind_inputs(inspect.signature(self.forward), args, kwargs))
        index = leaves.pop(INDEX_NAME)
        index = check_shared_call(
            leaves, index, self._request_rows_from, self._jagged, self._caps
        )
        inputs = [leaves[name] for name in self._input_names]
        # Interpreted with node metadata preserved, so the exported nodes keep the source module
        # of the nodes they come from (reports and drawings of a saved program name them).
        with fx_traceback.preserve_node_meta():
            outputs = self._interpreter(self.rewritten).run(*inputs, index)
        return self._contract.outputs(list(outputs))


def checking(interpreter: type[fx.Interpreter]) -> type[fx.Interpreter]:
    """``interpreter`` tracing, before each op whose functional wrapper checks its input in the
    original model (``runtime/program/eager_checks.py``; batch norm's, so far), that check
    (``input_checks.TRACED_EAGER_CHECKS``), so that the exported program refuses what the
    original model refuses."""

    class Checking(interpreter):
        def run_node(self, n: fx.Node) -> Any:
            traced = TRACED_EAGER_CHECKS.get(eager_check(n))
            if traced is not None:
                source = n.args[0]
                self.env[source] = traced(self.env[source])
            return super().run_node(n)

    return Checking


def _program_module(compiled, portable: bool) -> _SharedLayoutProgram:
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
    contract = compiled.contract
    specs = compiled._input_specs
    caps = specs.caps if specs is not None else []
    return cls(compiled.graph_module, contract.input_names, contract, portable, caps).eval()


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
    from ..formats.leaves import named_leaves

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


def export(
    compiled,
    example: Optional[Any] = None,
    portable: bool = False,
    dynamic: Optional[Mapping[str, Any]] = None,
) -> ExportedProgram:
    """A ``torch.export.ExportedProgram`` of ``compiled``'s rewritten graph in shared layout,
    as the next call would run it: weights changed since the last call are followed, and a model
    the guards refuse is refused (``CompiledModel.current_graph``).

    Args:
        compiled: a :class:`~rocs_compiler.CompiledModel` from ``rocs.compile`` (for request
            column ranges, the program takes the packed input's column pieces as inputs; for
            KeyedJaggedTensor keys, every key's padded pieces).
        example: an optional shared-layout batch (dict with ``candidate_to_request`` or a
            ``models_zoo.Batch``); by default zero-valued inputs with R = 2, N = 3 are used,
            which is enough because the graph has no data-dependent control flow.
        portable: replace every ``rocs::`` op by its plain-torch computation (``portable.py``):
            a program of ATen ops only, for processes without this package (AOTInductor's C++
            loader, ONNX Runtime, ``torch.export.load`` alone). The request side still runs
            once per request, and attention reads each request's keys and values per request;
            the other fused kernels' savings of memory traffic are not kept.
        dynamic: sizes past the rows to make dynamic in a model compiled from an example that did
            not mark them, ``{input: dim or [dims]}`` (a history length: ``{"hist_ids": 1}``):
            the compiled model is compiled again with them dynamic, as a call at another length
            would (``runtime/modes/new_sizes.py``), and the program takes every length; dims
            already dynamic are left as they are.
    """
    if getattr(compiled, "graph_module", None) is None:
        reason = getattr(compiled, "fallback_reason", None) or "not a rocs CompiledModel"
        raise CompileError(f"nothing to export: the model runs eagerly ({reason})")
    if dynamic:
        make_dynamic(compiled, dynamic)
    # What a call runs first: the guards refuse a changed model, and weights changed since the
    # last call (an optimizer step, load_state_dict) reach the folded constants.
    compiled.current_graph()
    flat = _flat_example(compiled, example)
    module = _program_module(compiled, portable)
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
            program = torch.export.export(
                module, (), example_kwargs, dynamic_shapes=_nest(dims), strict=False
            )
        except Exception as err:
            raise CompileError(
                f"could not export the rewritten graph: {type(err).__name__}: {err}"
            ) from err
    specs = compiled._input_specs
    plan = plan_of(compiled._jagged, specs.caps if specs is not None else ())
    if plan is not None:  # ``jagged_program.py``: its callers may cut their calls
        program.graph_module.meta[JAGGED_META] = plan
    return program


def save(program: ExportedProgram | LoadedProgram, path: str | os.PathLike) -> None:
    """``torch.export.save``; load it back with :func:`load`."""
    if isinstance(program, LoadedProgram):
        program = program.program
    plan = plan_of_program(program)
    extra_files = {JAGGED_FILE: json.dumps(plan)} if plan is not None else None
    with warnings.catch_warnings():
        # torch warns about weights shared between the graph's constants; they are CPU tensors
        # saved once and loaded exactly, so the warning says nothing about this program.
        warnings.filterwarnings("ignore", message="No complete tensor found in the group")
        torch.export.save(program, path, extra_files=extra_files)


class _PositionalCall(nn.Module):
    """An exported program's module behind ``forward(*arguments, candidate_to_request)``.

    ``ExportedProgram.module()`` of a program exported from keyword arguments takes keywords
    only; this binds positional arguments to the argument names in the model's order, so the
    call ``module(a_R, b_N, idx)`` equals ``module(a=a_R, b=b_N, candidate_to_request=idx)``.
    The index's dtype and length are checked against ``candidate_leaf`` (a leaf input with one
    row per candidate) before the program runs (``input_checks.check_loaded_index``).
    """

    def __init__(self, module: nn.Module, names: list[str], candidate_leaf: Optional[str] = None):
        super().__init__()
        self.program_module = module
        self.argument_names = list(names)
        self.candidate_leaf = candidate_leaf

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        names = self.argument_names
        if len(args) > len(names):
            raise TypeError(
                f"the program takes {len(names)} arguments ({', '.join(names)}), got {len(args)}"
            )
        twice = sorted(set(names[: len(args)]) & set(kwargs))
        if twice:
            raise TypeError(f"argument(s) given by position and by name: {', '.join(twice)}")
        call = {**dict(zip(names, args)), **kwargs}
        if INDEX_NAME in call:
            leaf = self.candidate_leaf
            check_loaded_index(call[INDEX_NAME], named_leaves(call).get(leaf) if leaf else None)
        try:
            return self.program_module(**call)
        except RuntimeError as err:
            refused = as_input_error(err)
            if refused is None:
                raise
            raise refused from err


class LoadedProgram:
    """A program saved by :func:`save`, callable like the original model plus
    ``candidate_to_request``: positional arguments in the model's order, or keywords.

    ``program`` is the ``torch.export.ExportedProgram``; :meth:`module` the ``nn.Module`` that
    runs it (what ``program.module()`` is, with positional arguments accepted). A program whose
    compiled model cut its calls to each request's history length (``jagged_program.py``) cuts
    them the same way: a call runs as groups of requests, through :meth:`module`.
    """

    def __init__(self, program: ExportedProgram):
        self.program = program
        self._module: Optional[_PositionalCall] = None
        plan = plan_of_program(program)
        self._jagged = JaggedProgram(self._keywords, plan) if plan is not None else None

    @property
    def argument_names(self) -> list[str]:
        """The program's arguments in call order, ``candidate_to_request`` last."""
        return _keyword_names(self.program)

    def module(self) -> nn.Module:
        if self._module is None:
            self._module = _PositionalCall(
                self.program.module(), self.argument_names, _candidate_leaf(self.program)
            )
        return self._module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._jagged is not None and INDEX_NAME in kwargs:
            names = self.argument_names
            if len(args) < len(names):
                return self._jagged(**dict(zip(names, args)), **kwargs)
        return self.module()(*args, **kwargs)

    def _keywords(self, **kwargs: Any) -> Any:
        return self.module()(**kwargs)

    def __repr__(self) -> str:
        return f"LoadedProgram({', '.join(self.argument_names)})"


def _candidate_leaf(program: ExportedProgram) -> Optional[str]:
    """A leaf input whose rows are the index's (one per candidate), or None when there is none."""
    signature = input_signature(program)
    index = signature.get(INDEX_NAME)
    rows = index["shape"][0] if index and index["shape"] else None
    for leaf, spec in signature.items():
        if leaf != INDEX_NAME and spec and spec["shape"] and spec["shape"][0] == rows:
            return leaf
    return None


def _keyword_names(program: ExportedProgram) -> list[str]:
    """The top-level keyword names of the program's inputs, in the order it was exported with
    (the model's argument order, then ``candidate_to_request``)."""
    return list(_keyword_spec(program).context)


def _keyword_spec(program: ExportedProgram):
    """The pytree spec of the program's keyword inputs (a rocs program takes no positional)."""
    in_spec = program.call_spec.in_spec
    # newer torch has children() and deprecates children_specs; older ones have only the field
    children = in_spec.children() if hasattr(in_spec, "children") else in_spec.children_specs
    args_spec, kwargs_spec = children
    if args_spec.num_children:
        raise CompileError("not a rocs program: it takes positional inputs")
    return kwargs_spec


def load(path: str | os.PathLike) -> LoadedProgram:
    """Load a program saved by :func:`save`, with the rocs:: custom ops registered: call it like
    the model, ``program(*arguments, candidate_to_request)``."""
    _register_rocs_ops()
    extra_files = {JAGGED_FILE: ""}
    program = torch.export.load(path, extra_files=extra_files)
    plan = read_plan(extra_files[JAGGED_FILE])
    if plan is not None:
        program.graph_module.meta[JAGGED_META] = plan
    return LoadedProgram(program)


# The AOTInductor package's metadata entry that describes the program's keyword inputs, which the
# package (compiled code, no graph) cannot tell otherwise: ``json.dumps(input_signature(...))``.
INPUTS_METADATA = "rocs.inputs"


def aoti_package(
    program: ExportedProgram | LoadedProgram, path: str | os.PathLike, **inductor_configs: Any
) -> str:
    """Compile ``program`` ahead of time with AOTInductor into a ``.pt2`` package.

    Needs a C++ compiler. The package of a portable program runs anywhere libtorch does (a C++
    program through ``AOTIModelPackageLoader``: ``examples/cpp/aoti_run.cpp``). Load the package of
    any other program with ``torch._inductor.aoti_load_package(path)`` in a
    process that has imported ``rocs_compiler`` (the package calls the rocs:: ops' CPU
    kernels through the dispatcher when the graph contains them). The package's metadata
    (``runner.get_metadata()[INPUTS_METADATA]``) describes its inputs (:func:`input_signature`),
    which is how ``rocs serve`` serves it.

    The package checks each input's dtype, sizes and strides against the program's and refuses
    one that differs, a strided view included, which it would otherwise read with the compiled
    strides and score wrongly (``export/aoti_checks.py``; docs/deploy.md). A server that copies
    its inputs itself may turn the check off with ``AOTI_RUNTIME_CHECK_INPUTS=0``.
    """
    if isinstance(program, LoadedProgram):
        program = program.program
    configs = dict(inductor_configs)
    # Inductor assumes every dynamic size is at least 2 and, with its input checks on, would
    # refuse R = 1 or N = 1 (one request, one candidate) and the empty batch; the program
    # computes them exactly and checks R and N itself.
    configs.setdefault("aot_inductor.check_lowerbound", False)
    metadata = dict(configs.pop("aot_inductor.metadata", None) or {})
    metadata[INPUTS_METADATA] = json.dumps(input_signature(program))
    plan = plan_of_program(program)
    if plan is not None:  # ``jagged_program.py``: a caller may cut its calls
        metadata[JAGGED_META] = json.dumps(plan)
    configs["aot_inductor.metadata"] = metadata
    with input_checks_by_default():  # ``export/aoti_checks.py``: a strided view is refused
        return torch._inductor.aoti_compile_and_package(
            program, package_path=os.fspath(path), inductor_configs=configs
        )


def input_signature(program: ExportedProgram) -> dict[str, Optional[dict]]:
    """Each keyword input of ``program`` by its leaf name (``features.user_age`` inside a dict),
    ``candidate_to_request`` included: ``{"dtype": "float32", "shape": [...]}`` with a dynamic
    size by its name (``"R"``, ``"N"``, ``"L_history"``: ``size_names.py``; sizes that share a
    name are equal), or None for an input that is not a tensor."""
    return with_size_names(symbolic_signature(program))


def symbolic_signature(program: ExportedProgram) -> dict[str, Optional[dict]]:
    """:func:`input_signature` with each dynamic size as the name of its symbol (``"s23"``)."""
    kwargs_spec = _keyword_spec(program)
    positions = named_leaves(
        pytree.tree_unflatten(list(range(kwargs_spec.num_leaves)), kwargs_spec)
    )
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    user_inputs = list(program.graph_signature.user_inputs)
    signature: dict[str, Optional[dict]] = {}
    for leaf, i in positions.items():
        val = placeholders[user_inputs[i]].meta.get("val")
        if not isinstance(val, torch.Tensor):
            signature[leaf] = None
            continue
        shape = [s if isinstance(s, int) else str(s) for s in val.shape]
        signature[leaf] = {"dtype": str(val.dtype).removeprefix("torch."), "shape": shape}
    return signature
