"""Lowering of the graphs the backend hands back to dynamo: Inductor, or the graph itself."""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
from torch import fx, nn

from ..analysis.batch_axis import LEADING
from ..export.portable import portable_graph_module
from ..ir.graph_meta import BATCH_AXIS, PLACEMENT
from ..ir.roles import Role
from .compiled_frame import MISS, CompiledFrame


_INDUCTOR = {"size_asserts": False}  # the class docstring says why

# Guards on the identity of functions and modules of torch and of rocs that the portable graph's
# code reads as globals (``G['torch'].ops.aten.add``, a portable form's helper).
_IDENTITY_GUARDS = frozenset(
    {"MODULE_MATCH", "BUILTIN_MATCH", "CLOSURE_MATCH", "FUNCTION_MATCH", "ID_MATCH", "TYPE_MATCH"}
)
_OWN_GLOBALS = ("G['torch']", "G['__import_torch", "G['__import_rocs_compiler", "G['rocs_compiler")
_SELF = ("self", "L['self']")  # the frame's module, as dynamo names it


def _guard_filter(entries) -> list[bool]:
    """Which of dynamo's guards on a lowered graph's frame to keep (``guard_filter_fn``): all but
    those on the portable module's own state, and on the identity of torch's and rocs's functions
    its code calls (the class docstring says why neither can fail)."""
    return [not _never_fails(e) for e in entries]


def _never_fails(entry) -> bool:
    name = entry.name
    if any(name == s or name.startswith((s + ".", s + "[")) for s in _SELF):
        return True
    return (
        entry.is_global
        and entry.guard_type in _IDENTITY_GUARDS
        and name.startswith(_OWN_GLOBALS)
        and "hooks" not in name  # the global module hooks are the user's to register
    )


def _compile_options() -> dict:
    """``torch.compile``'s options for a lowered graph: a new dict each time (``torch.compile``
    takes ``guard_filter_fn`` out of the dict it is given); a torch without the filter keeps
    every guard."""
    from torch._dynamo import types

    if not hasattr(types, "GuardFilterEntry"):
        return dict(_INDUCTOR)
    return {**_INDUCTOR, "guard_filter_fn": _guard_filter}


class Lowered(nn.Module):
    """Runs the rewritten FX graph through Inductor; through FX if Inductor fails (with a warning).

    Inductor compiles the graph with every ``rocs::`` op in its portable form
    (``export/portable.py``: the request term at R rows and its gather in ATen ops), which it fuses
    with the kernels around it; an opaque op would also check its index on every call, which the
    runtime has done once before the graph runs.

    The graph is compiled lazily at the first call, dynamic in R and N. R and N are first marked
    *unbacked* so that neither dynamo's 0/1 specialization nor Inductor's size guards recompile for
    R = 1 or N = 1 (one request per batch is the common serving case). Dynamo must trace the graph
    whole with them: a check that an unbacked size cannot answer (a batch norm's or a reshape's
    over the candidates' rows) would break the graph there and run it as two compiled frames, each
    through dynamo's call (10-13 % of din's and hstu's door calls). Where Inductor cannot compile
    the graph, or dynamo cannot trace it whole, with both unbacked, R alone is marked unbacked
    (the request inputs' rows; N then specializes at one candidate), and then neither: the
    ordinary dynamic-shape compile. A graph whose request
    values hold the batch elsewhere than dim 0 (``[L, R, D]``, heads merged into ``[R*H, L, d]``)
    is compiled dynamic only: with unbacked sizes Inductor computed wrong values for such graphs
    (an ``nn.TransformerEncoder`` over ``[L, B, D]``). A graph with an attention starts at R alone
    unbacked, as its mask's broadcast asks whether a size is 1, which an unbacked size cannot
    answer: bst's graph then compiles once for every R; where R is asked (target_attention:
    ``Eq(R, 1)``), the dynamic compile follows, with a second entry the first time R = 1.

    Inductor's code is generated without its input asserts (``size_asserts``), which check each
    input's sizes and strides on every call (one Python call per input: 48 at glm_dcnv2, a tenth
    of its graph's time at one request). Nothing the asserts would catch reaches the graph: the
    inputs' dtypes, devices and sizes past the batch pick the variant, their strides are made
    contiguous below and dynamo's guards check them on the frame's locals; the constants are the
    module state the subgraph checks by identity, version and data pointer before every call
    (``subgraph.py``). The ops Inductor runs as fallbacks are ATen's, whose shapes it computes
    with PyTorch's own meta functions (the ``rocs::`` ops arrive in their portable forms).

    Of the guards dynamo builds for the compiled graph's frame, two kinds are left out
    (``guard_filter_fn``), as they cannot fail; every other guard stays (the global state, grad
    mode, the shape environment's relations, each input's dtype, device, sizes and strides):

    - those on the portable module itself (its type, its dicts, each constant's sizes and
      strides: 43 tensors at glm_dcnv2). That module is built here from the rewritten graph and
      kept private; nothing assigns to its attributes afterwards (the runtime's weight following
      rebinds the rewritten graph's attributes, never the portable copy's), so what those guards
      check is what they saw at compile time;
    - those on the identity of torch's and rocs's own functions and modules that its code reads as
      globals (``torch.ops.aten.add``, a portable form's helper): replacing them at run time is
      no supported use.

    Checked after the call's kernels have evicted what they read, guards cost more than their
    count says: at glm_dcnv2, 1 x 270, the frame's whole check took 6.9 us hot and 22.5 us after
    an 8 MB pass, in a door call of about 470 us (docs/SPEED.md).

    After the first compile, a call runs the compiled graph whose dynamo guards accept it without
    going through ``torch.compile``'s call (``compiled_frame.py``); one no guard accepts compiles
    as before.

    Tensors reach the compiled graph with the strides of a contiguous tensor of their shape:
    dynamo guards on strides, and the runtime hands over views whose strides change with the
    batch (the request rows of equal-sized requests are one row in every N, ``x[::N]``), so each
    new layout would recompile, and past dynamo's recompile limit run uncompiled. Only strides of
    size-1 dims differing, the tensor is re-strided without a copy; any other layout is copied,
    unless the graph is not ``functional`` and may write to its inputs.
    """

    def __init__(self, gm: fx.GraphModule, use_inductor: bool, functional: bool = True):
        super().__init__()
        self.gm = gm
        # Inductor compiles the ops' portable forms, which it fuses with the kernels around them;
        # the runtime has checked the index once for the call before the graph runs.
        self._portable = portable_graph_module(gm) if use_inductor else gm
        self._copy_layouts = functional  # a graph that writes to its inputs must get the originals
        self._roles = [
            n.meta.get(PLACEMENT, Role.CONST) for n in gm.graph.nodes if n.op == "placeholder"
        ]
        self._strategies = [*_UNBACKED, "dynamic"] if use_inductor else []
        if _batch_moves(gm):
            self._strategies = self._strategies[-1:]
        elif _attends(gm):
            self._strategies = self._strategies[-2:]
        self._compiled = {
            s: torch.compile(
                self._portable, backend="inductor", dynamic=True, options=_compile_options()
            )
            for s in self._strategies
        }
        # Once compiled, calls run the compiled entries without dynamo's call machinery.
        self._frame: Optional[CompiledFrame] = None
        self._errors: list[str] = []
        self._succeeded = False

    @property
    def graph(self) -> fx.Graph:
        """The FX graph it runs: the runtime reads graph-level facts (e.g. constant outputs)."""
        return self.gm.graph

    @property
    def uses_inductor(self) -> bool:
        return bool(self._strategies)

    def forward(self, *args):
        if not self._strategies:
            return self.gm(*args)
        strategy = self._strategies[0]
        try:
            prepared = self._prepare(strategy, args)
            frame = self._frame
            out = frame(prepared) if frame is not None else MISS
            if out is MISS:
                compiled = self._compiled[strategy]
                with _whole_graph(strategy):
                    out = compiled(*prepared)
                if frame is None:
                    module = getattr(compiled, "_orig_mod", self._portable)
                    frame = self._frame = CompiledFrame(module)
                frame.missed()
        except Exception as err:
            # Bad inputs fail the FX graph too and propagate from here; Inductor is not blamed.
            out = self.gm(*args)
            self._frame = None  # the next strategy's compile makes its own
            self._errors.append(f"{strategy}: {describe_failure(err)}")
            self._strategies.pop(0)
            if _broke(strategy, err) and self._strategies:
                return out  # the next strategy, with fewer sizes unbacked, may trace it whole
            # Any other failure (Inductor's) goes to the dynamic-shape compile, as it always has.
            self._strategies = [s for s in self._strategies if s not in _UNBACKED]
            if self._succeeded or not self._strategies:
                warnings.warn(
                    "rocs: Inductor failed on the rewritten graph; running it as an FX graph "
                    "instead (" + "; ".join(self._errors) + ")",
                    stacklevel=2,
                )
                self._strategies.clear()
            return out
        if not self._succeeded:
            self._succeeded = True
        return out

    def _prepare(self, strategy: str, args: tuple) -> tuple:
        # Marks matter to the compile only: the compiled graph has no guard on an unbacked size.
        copy = self._copy_layouts
        unbacked = _UNBACKED.get(strategy)
        if unbacked is None or self._succeeded:
            return tuple([
                _with_contiguous_strides(v, copy) if isinstance(v, torch.Tensor) else v
                for v in args
            ])  # fmt: skip
        from torch._dynamo.decorators import mark_unbacked

        out = []
        for value, role in zip(args, self._roles):
            if isinstance(value, torch.Tensor):
                value = _with_contiguous_strides(value, copy)
                if role in unbacked and value.dim():
                    value = value.detach()  # mark an alias, never the caller's tensor
                    mark_unbacked(value, 0)
            out.append(value)
        return tuple(out)


# The strategies that mark batch sizes unbacked, each with the placements whose rows it marks.
_UNBACKED = {"unbacked": (Role.REQUEST, Role.CANDIDATE), "unbacked requests": (Role.REQUEST,)}


def _whole_graph(strategy: str):
    """Where the strategy marks sizes unbacked, a context in which dynamo raises at a graph break
    rather than compiling the graph in pieces (the class docstring says why); else, and on a torch
    without the switch, no context."""
    switch = getattr(torch._dynamo, "error_on_graph_break", None)
    if strategy not in _UNBACKED or switch is None:
        return contextlib.nullcontext()
    return switch(True)


def _broke(strategy: str, err: BaseException) -> bool:
    """True when ``err`` is dynamo refusing a graph break under :func:`_whole_graph` (a guard an
    unbacked size cannot answer is a ``UserError``, another break ``Unsupported``)."""
    from torch._dynamo.exc import Unsupported, UserError

    return strategy in _UNBACKED and isinstance(err, (Unsupported, UserError))


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _with_contiguous_strides(value: torch.Tensor, copy: bool) -> torch.Tensor:
    """``value`` with the strides ``torch.empty(value.shape)`` has. A tensor that is contiguous
    but for the strides of size-1 dims (which address nothing) is re-strided without a copy;
    any other layout is copied when ``copy`` is set."""
    shape = value.shape
    if value.is_contiguous():
        if 1 not in shape and 0 not in shape:  # no dim whose stride addresses nothing
            return value
        want = _contiguous_strides(shape)
        return value if value.stride() == want else value.as_strided(shape, want)
    return value.contiguous() if copy else value


def _batch_moves(gm: fx.GraphModule) -> bool:
    """True when some request value of ``gm`` holds the batch elsewhere than a plain dim 0."""
    for node in gm.graph.nodes:
        axes = node.meta.get(BATCH_AXIS)
        axes = axes if isinstance(axes, tuple) else (axes,)
        if any(axis is not None and axis != LEADING for axis in axes):
            return True
    return False


def _attends(gm: fx.GraphModule) -> bool:
    """True when ``gm`` holds an attention: its mask's broadcast asks whether a size is 1, which
    an unbacked size cannot answer (the class docstring says what follows)."""
    targets = {"broadcast_attention", "scaled_dot_product_attention"}
    return any(
        node.op == "call_function" and getattr(node.target, "_opname", None) in targets
        for node in gm.graph.nodes
    )


def describe_failure(err: BaseException) -> str:
    """``Type: first line of the message``; for an exception raised without a message, where it
    was raised, so that a warning always says why."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if lines:
        return f"{type(err).__name__}: {lines[0]}"
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return f"{type(err).__name__} (no message)"
    where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}"
    return f"{type(err).__name__} (no message, raised at {where})"


def lower_plain(gm: fx.GraphModule, example_inputs: Sequence[Any], use_inductor: bool) -> Callable:
    """Lower a dynamo graph that rocs does not rewrite, while dynamo compiles its frame: with
    Inductor, or as the graph itself when Inductor fails (with a warning naming why).

    Dynamo's requests to restart its analysis (``RestartAnalysis``: Inductor asking for a float to
    be specialized, say) are not failures: they propagate, dynamo traces the frame again and
    calls the backend anew."""
    if use_inductor:
        from torch._dynamo.exc import RestartAnalysis
        from torch._inductor.compile_fx import compile_fx

        try:
            return compile_fx(gm, list(example_inputs))
        except RestartAnalysis:
            raise
        except Exception as err:
            warnings.warn(
                f"rocs: Inductor failed, running the FX graph instead: {describe_failure(err)}",
                stacklevel=2,
            )
    return gm.forward
