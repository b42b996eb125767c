"""Straight-line Python for running a compiled graph, with its ops called directly.

A compiled graph keeps ``torch.ops.rocs.*`` nodes: that is what export, the reports and the
verifier read. Calling them through the dispatcher costs each call the custom-op machinery
plus the op's argument checks, about 50 us on a CPU, which for the small GEMMs of a ranking
model is as much as the GEMM itself. Inside the runtime those checks are redundant: shapes
and dtypes were fixed when the graph was traced (fake-tensor propagation through each op's
fake kernel), and ``candidate_to_request`` is checked once per call by the runtime before
the graph runs. A :class:`DirectProgram` therefore calls each op's device dispatch
(``RocsOp.run``: Triton on CUDA, the torch path on the CPU) with no checks.

The rest of the graph is small ops on a few rows (the request side runs on R rows), where the
Python around each call matters as much as the call: FX's generated code reaches every op
through ``torch.ops.aten.<op>.<overload>`` and every weight through ``Module.__getattr__``.
The program binds each op's C++ callable and each weight once, as globals of its code (an
ATen op through torch's generated Python binding where one is equivalent, ``bindings.py``),
and runs an elementwise op in place when its operand is a dying temporary (``inplace.py``), and,
in an inference program, a few ops by a faster kernel where the node's shapes allow it
(``lowerings.py``). Where a functional wrapper checked its input's size before the op, the program
makes the same check (``eager_checks.py``).

Profiler labels: the program is generated twice from one body. The plain function runs when no
profiler is active; when one is, the call takes the *profiled* function, which wraps the
request-placed nodes in one ``rocs::request_region`` range, the candidate-placed ones in one
``rocs::candidate_region`` range and every fused op in ``rocs::<op>`` (its direct call bypasses
the dispatcher, which would otherwise name it). For one range per region, nodes are scheduled
request region first: a node never reads a value placed higher than itself (``PLACEMENT``), so
CONST and REQUEST nodes can all run before the first CANDIDATE node. The only cost without a
profiler is one check per call.

Identities relied on: ``torch.ops.rocs.X(*args) == ROCS_OPS["X"].run(*args)`` whenever the
op's checks pass (the op body is ``checks; return run(*args)``), and ``overload(*a) == overload._op(*a)``
(``OpOverload.__call__`` is exactly that call).
"""

from __future__ import annotations

import itertools
import linecache
import operator
from typing import Any, Callable, Optional

import torch
from torch import fx

from rocs_compiler.ir.graph_meta import PLACEMENT
from rocs_compiler.kernels import ROCS_OPS
from rocs_compiler.ir.roles import Role
from rocs_compiler.runtime.program.bindings import fast_callable
from rocs_compiler.runtime.program.eager_checks import eager_check
from rocs_compiler.runtime.program.inplace import inplace_plan
from rocs_compiler.runtime.program.lowerings import lowering

# rocs:: ops called without their checks, which the runtime has made once for the call.
RUNNERS: dict[object, Callable[..., torch.Tensor]] = {op.overload: op.run for op in ROCS_OPS.values()}
# The same under autograd: each call an autograd node with the op's registered backward.
DIFFERENTIABLE_RUNNERS: dict[object, Callable[..., torch.Tensor]] = {
    op.overload: op.run_with_backward for op in ROCS_OPS.values()
}

# The node kinds of the graphs rocs builds (torch.export output, rewritten); ``direct_program``
# leaves any other graph to FX.
NODE_KINDS = frozenset({"placeholder", "get_attr", "call_function", "output"})
_INLINE_LITERALS = (bool, int, str, type(None))
_PROGRAM_IDS = itertools.count()


class DirectProgram:
    """``gm``'s graph as one Python function; ``source`` holds its text.

    The program holds references to ``gm``'s parameters and buffers as they are when it is
    built: rebuild it when they are replaced (``Module.to`` replaces buffers); in-place updates
    (``load_state_dict``, optimizers) are seen.

    ``differentiable=True`` builds the program for autograd (the training program): each fused
    op is :meth:`RocsOp.run_with_backward`, and no op runs in place (autograd may have saved
    the operand for a backward).
    """

    def __init__(self, gm: fx.GraphModule, differentiable: bool = False):
        unsupported = [f"{n.name} ({n.op})" for n in gm.graph.nodes if n.op not in NODE_KINDS]
        if unsupported:
            raise ValueError(f"DirectProgram runs {sorted(NODE_KINDS)} nodes only, not {unsupported}")
        self._globals: dict[str, Any] = {}
        self._ids: dict[int, str] = {}
        self._names: dict[fx.Node, str] = {}  # a node's local variable, or its constant's global
        nodes = _request_region_first(list(gm.graph.nodes))
        regions = _regions(nodes)
        last_use = {}
        for node in nodes:
            for arg in node.all_input_nodes:
                last_use[arg] = node
        runners = DIFFERENTIABLE_RUNNERS if differentiable else RUNNERS
        inplace = {} if differentiable else inplace_plan(nodes, last_use, set(RUNNERS))
        params, body = [], []  # body: (region, label of a fused op or None, lines)
        for node in nodes:
            if node.op == "get_attr":
                self._names[node] = self._bind(operator.attrgetter(node.target)(gm), "w")
                continue
            var = self._names[node] = f"v_{node.name}"
            if node.op == "placeholder":
                params.append(var)
                continue
            if node.op == "output":
                returned = f"return {self._render(node.args[0])}"
                continue
            target, node_args = inplace.get(node, (node.target, node.args))
            fn = self._bind(_callable(target, runners), "f")
            args = [self._render(a) for a in node_args]
            call = ", ".join(args + [f"{k}={self._render(v)}" for k, v in node.kwargs.items()])
            line = f"{fn}({call})"
            lowered = None if differentiable or node in inplace else lowering(node)
            if lowered is not None:
                faster = self._bind(lowered.fn, "f")
                line = f"{faster}({call}) if {lowered.when.format(*args)} else {line}"
            lines = [f"{var} = {line}"]
            check = eager_check(node)
            if check is not None:  # the functional wrapper's check, before its op
                lines.insert(0, f"{self._bind(check, 'f')}({args[0]})")
            # Drop values after their last use, as FX's code does, so temporaries free early.
            dead = [
                self._names[a] for a in node.all_input_nodes if last_use[a] is node and a.op != "get_attr"
            ]
            if dead:
                lines.append(f"del {', '.join(dict.fromkeys(dead))}")
            label = _fused_label(node.target) if node.target in RUNNERS else None
            body.append((regions.get(node), label, lines))
        self._globals["_range"] = torch.profiler.record_function
        plain = [line for _, _, lines in body for line in lines] + [returned]
        self.source = _function("program", params, plain)
        self.profiled_source = _function("profiled", params, _profiled_body(body) + [returned])
        self._fn = self._load(self.source, "program")
        self._profiled = self._load(self.profiled_source, "profiled")

    def _load(self, source: str, name: str) -> Callable:
        # Registered with linecache so that tracebacks through the program show its lines.
        filename = f"<rocs direct {name} {next(_PROGRAM_IDS)}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), self._globals)
        return self._globals[name]

    def __call__(self, *args: Any) -> Any:
        if _profiler_enabled():
            return self._profiled(*args)
        return self._fn(*args)

    def constants(self) -> list[Any]:
        """The tensors the program holds (weights and folded constants)."""
        return [v for k, v in self._globals.items() if k.startswith("w") and isinstance(v, torch.Tensor)]

    def _bind(self, value: Any, prefix: str) -> str:
        name = self._ids.get(id(value))
        if name is None:
            name = f"{prefix}{len(self._ids)}"
            self._ids[id(value)] = name
            self._globals[name] = value
        return name

    def _render(self, arg: Any) -> str:
        if isinstance(arg, fx.Node):
            return self._names[arg]
        if isinstance(arg, (list, tuple)):
            items = ", ".join(self._render(a) for a in arg)
            return f"[{items}]" if isinstance(arg, list) else f"({items}{',' if len(arg) == 1 else ''})"
        if isinstance(arg, dict):
            return "{" + ", ".join(f"{k!r}: {self._render(v)}" for k, v in arg.items()) + "}"
        if isinstance(arg, _INLINE_LITERALS):
            return repr(arg)
        return self._bind(arg, "k")


_profiler_enabled = torch._C._autograd._profiler_enabled
_REGION_NAMES = {Role.REQUEST: "rocs::request_region", Role.CANDIDATE: "rocs::candidate_region"}


def _region_of(node: fx.Node) -> Optional[Role]:
    placement = node.meta.get(PLACEMENT)
    if placement is None:
        return None
    return Role.CANDIDATE if placement == Role.CANDIDATE else Role.REQUEST


def _request_region_first(nodes: list[fx.Node]) -> list[fx.Node]:
    """``nodes`` with every CONST and REQUEST node before the CANDIDATE ones, when every
    computing node has a placement and that order is valid; else ``nodes`` unchanged."""
    computing = [n for n in nodes if n.op == "call_function"]
    if not computing or any(_region_of(n) is None for n in computing):
        return nodes
    head = [n for n in nodes if n.op in ("placeholder", "get_attr")]
    order = (
        head
        + [n for n in computing if _region_of(n) == Role.REQUEST]
        + [n for n in computing if _region_of(n) == Role.CANDIDATE]
        + [n for n in nodes if n.op == "output"]
    )
    seen: set[fx.Node] = set()
    for node in order:
        if any(a not in seen for a in node.all_input_nodes):
            return nodes
        seen.add(node)
    return order


def _regions(nodes: list[fx.Node]) -> dict[fx.Node, Role]:
    """The region of each computing node, if the nodes run as contiguous regions; else none."""
    regions = {n: _region_of(n) for n in nodes if n.op == "call_function"}
    sequence = [r for r in regions.values()]
    if None in sequence or sequence != sorted(sequence):
        return {}
    return regions


def _fused_label(target: Any) -> str:
    return f"rocs::{target._schema.name.split('::')[-1]}"


def _function(name: str, params: list[str], lines: list[str]) -> str:
    return "def {}({}):\n    {}\n".format(name, ", ".join(params), "\n    ".join(lines))


def _profiled_body(body: list[tuple[Optional[Role], Optional[str], list[str]]]) -> list[str]:
    """The lines of ``body`` inside one range per region and one per fused op."""
    out: list[str] = []
    for region, group in itertools.groupby(body, key=lambda item: item[0]):
        indent = ""
        if region is not None:
            out.append(f"with _range({_REGION_NAMES[region]!r}):")
            indent = "    "
        for _, label, lines in group:
            if label is None:
                out.extend(indent + line for line in lines)
            else:
                out.append(f"{indent}with _range({label!r}):")
                out.extend(f"{indent}    {line}" for line in lines)
    return out


def _callable(target: Any, runners: dict) -> Callable:
    if target in runners:
        return runners[target]
    if isinstance(target, torch._ops.OpOverload):
        return fast_callable(target) or target._op
    return target


def direct_program(gm: fx.GraphModule, differentiable: bool = False) -> Callable:
    """``gm`` as a :class:`DirectProgram`; ``gm`` itself if its graph has other node kinds."""
    if any(n.op not in NODE_KINDS for n in gm.graph.nodes):
        return gm
    return DirectProgram(gm, differentiable)
