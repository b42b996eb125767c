"""Lowering of the graphs the backend hands back to dynamo: Inductor, or the graph itself."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch
from torch import fx, nn

from ..analysis.batch_axis import LEADING
from ..ir.graph_meta import BATCH_AXIS, PLACEMENT
from ..ir.roles import Role


class Lowered(nn.Module):
    """Runs the rewritten FX graph through Inductor; through FX if Inductor fails (with a warning).

    The graph is compiled lazily at the first call, dynamic in R and N. R and N are first marked
    *unbacked* so that neither dynamo's 0/1 specialization nor Inductor's size guards recompile for
    R = 1 or N = 1 (one request per batch is the common serving case); if Inductor cannot compile
    with unbacked sizes, the ordinary dynamic-shape compile is tried next. A graph whose request
    values hold the batch elsewhere than dim 0 (``[L, R, D]``, heads merged into ``[R*H, L, d]``)
    is compiled dynamic only: with unbacked sizes Inductor computed wrong values for such graphs
    (an ``nn.TransformerEncoder`` over ``[L, B, D]``).
    """

    def __init__(self, gm: fx.GraphModule, use_inductor: bool):
        super().__init__()
        self.gm = gm
        self._batched = [
            n.meta.get(PLACEMENT, Role.CONST) != Role.CONST for n in gm.graph.nodes if n.op == "placeholder"
        ]
        self._strategies = ["unbacked", "dynamic"] if use_inductor else []
        if _batch_moves(gm):
            self._strategies = self._strategies[1:]
        self._compiled = {
            s: torch.compile(gm, backend="inductor", dynamic=True) for s in self._strategies
        }
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
            out = self._compiled[strategy](*self._prepare(strategy, args))
        except Exception as err:
            # Bad inputs fail the FX graph too and propagate from here; Inductor is not blamed.
            out = self.gm(*args)
            self._errors.append(f"{strategy}: {type(err).__name__}: {_first_line(err)}")
            self._strategies.pop(0)
            if self._succeeded or not self._strategies:
                warnings.warn(
                    "rocs: Inductor failed on the rewritten graph; running it as an FX graph "
                    "instead (" + "; ".join(self._errors) + ")",
                    stacklevel=2,
                )
                self._strategies.clear()
            return out
        self._succeeded = True
        return out

    def _prepare(self, strategy: str, args: tuple) -> tuple:
        if strategy != "unbacked":
            return args
        from torch._dynamo.decorators import mark_unbacked

        out = []
        for value, batched in zip(args, self._batched):
            if batched and isinstance(value, torch.Tensor) and value.dim():
                value = value.detach()  # mark an alias, never the caller's tensor
                mark_unbacked(value, 0)
            out.append(value)
        return tuple(out)


def _batch_moves(gm: fx.GraphModule) -> bool:
    """True when some request value of ``gm`` holds the batch elsewhere than a plain dim 0."""
    for node in gm.graph.nodes:
        axes = node.meta.get(BATCH_AXIS)
        axes = axes if isinstance(axes, tuple) else (axes,)
        if any(axis is not None and axis != LEADING for axis in axes):
            return True
    return False


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def lower_plain(gm: fx.GraphModule, example_inputs: Sequence[Any], use_inductor: bool) -> Callable:
    """Lower a dynamo graph that rocs does not rewrite (Inductor, or the graph itself)."""
    if use_inductor:
        try:
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, list(example_inputs))
        except Exception as err:
            warnings.warn(
                f"rocs: Inductor failed, running the FX graph instead: {type(err).__name__}: {err}",
                stacklevel=2,
            )
    return gm.forward
