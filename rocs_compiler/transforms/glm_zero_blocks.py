"""``glm_from_zero_blocks``: the GLM form of a model whose masks were trained by hand.

A model trained with plain ``nn.Linear`` layers whose request rows were kept exactly zero on the
candidate columns (by a mask multiplied after each step, or a gradient hook) computes GLM values,
but the compiler cannot share them: it reads structure, never weight values, because a zero
weight times an infinite candidate feature is NaN, and zeros of ordinary weights change when
weights are refreshed. This explicit step turns such layers into structurally masked
:class:`~rocs_compiler.layers.GLMLinear` layers whose forward never reads the zero block.

The identity relied on: when ``W[rows, candidate columns]`` is exactly zero,

    ``linear(x, W, b)[..., rows] == linear(x[..., request columns], W[rows][:, request columns],
    b[rows])``

for every finite ``x`` (up to the order of the sum and the sign of a zero); with an inf or NaN in
a candidate column the GLM layer gives the finite value where the plain layer gave NaN, which is
the point of the step: the request rows no longer depend on candidate inputs.

The lanes come from the lane analysis (:mod:`rocs_compiler.analysis.segments`) on the example
batch: walking the captured graph in order, every plain ``nn.Linear`` called once whose input has
request and candidate columns is checked for *blocks*, runs of output rows whose weights on the
candidate columns are mostly exact zeros. A block that is exactly zero becomes request rows of a
``GLMLinear``; its output lanes are predicted in the same walk, so the next layer sees them. A
block with any nonzero entry is not converted (a row that reads a candidate column is not a
request row, and keeping half a block would leave lanes nobody trained), and the report says how
many entries are nonzero and how large.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from ..analysis.driver import analyze, source_module
from ..analysis.segments import Ranges, lane_ranges, request_columns, run_taints
from ..capture.trace import capture, describe_example
from .glm_generic import GLMReport, infer_example_kwargs, plain_layer_of
from .layers import GLMLinear

__all__ = ["glm_from_zero_blocks"]

aten = torch.ops.aten

# A run of rows whose candidate-column weights are at least this share exact zeros is taken as a
# block meant to be zero (trained weights have no exact zeros by chance).
BLOCK_ZERO_SHARE = 0.5


def glm_from_zero_blocks(
    model: nn.Module,
    request_inputs: Sequence[str] | str,
    example_inputs: tuple = (),
    example_kwargs: Mapping[str, Any] | None = None,
) -> nn.Module:
    """A copy of ``model`` whose exact-zero request blocks are structural GLM masks.

    Every plain ``nn.Linear`` whose input mixes request and candidate columns (lanes found on
    the example batch) and whose output rows include runs that are exactly zero on every
    candidate column becomes a :class:`~rocs_compiler.layers.GLMLinear`: those rows are its
    request lanes, computed from the request columns only. Weights and module names are kept
    (the layer's raw weight equals the plain weight) and the original's state dict loads.

    Args:
        model: the trained model (any ``nn.Module``; not modified).
        request_inputs: its request-side inputs (argument names, or ``"arg.key"``).
        example_inputs, example_kwargs: one replicated example batch; inferred as
            :func:`~rocs_compiler.apply_glm` does when left out.

    Returns the new model in ``model``'s train/eval mode with a
    :class:`~rocs_compiler.transforms.glm_generic.GLMReport` as ``rocs_glm_report``: converted
    layers with their blocks, layers kept dense and why, and blocks refused because they are not
    exactly zero (also listed in a warning).
    """
    if isinstance(request_inputs, str):
        request_inputs = [request_inputs]
    if example_kwargs is None and not example_inputs:
        example_kwargs = infer_example_kwargs(model)
    new = copy.deepcopy(model).eval()
    finder = _BlockFinder(new)
    finder.run(list(request_inputs), tuple(example_inputs), dict(example_kwargs or {}))
    report = GLMReport(kept=finder.kept, refused=finder.refused)
    for path, (request_in, request_out) in finder.plans.items():
        new.set_submodule(path, _glm_linear(new.get_submodule(path), request_in, request_out))
        report.transformed[path] = finder.described[path]
    if report.refused:
        listed = "; ".join(f"{p}: {why}" for p, why in report.refused.items())
        warnings.warn(
            f"glm_from_zero_blocks: {len(report.refused)} layer(s) not converted: {listed}",
            stacklevel=2,
        )
    new.rocs_glm_report = report
    return new.train(model.training)


def _glm_linear(old: nn.Linear, request_in: Ranges, request_out: Ranges) -> GLMLinear:
    n_in = sum(b - a for a, b in request_in)
    n_out = sum(b - a for a, b in request_out)
    new = GLMLinear(
        n_in, old.in_features - n_in, n_out, old.out_features - n_out,
        bias=old.bias is not None, request_in=request_in, request_out=request_out,
    ).to(device=old.weight.device, dtype=old.weight.dtype)  # fmt: skip
    # The load pre-hook multiplies by the mask (on the layer's device): the block is zero already.
    new.load_state_dict(old.state_dict())
    return new


def _span(ranges: Ranges) -> str:
    return ", ".join(f"{a}:{b}" for a, b in ranges)


class _BlockFinder:
    """One walk over the captured model: the request rows of every plain mixed Linear."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.plans: dict[str, tuple[Ranges, Ranges]] = {}
        self.described: dict[str, str] = {}
        self.kept: dict[str, str] = {}
        self.refused: dict[str, str] = {}

    def run(self, request_inputs: list[str], example_args: tuple, example_kwargs: dict) -> None:
        call = describe_example(self.model, example_args, example_kwargs, request_inputs)
        cg = capture(self.model, example_args, example_kwargs, request_inputs)
        gm = cg.graph_module
        analyze(gm, {cg.placeholder_of[n] for n in cg.request_inputs}, cg.batch_symbol)
        self.sites: dict[str, int] = {}
        for node in gm.graph.nodes:
            if self._module(node) is not None:
                path = source_module(node)
                self.sites[path] = self.sites.get(path, 0) + 1
        run_taints(gm, [call.leaves[n] for n in cg.input_names], self.visit)

    def _module(self, node: fx.Node) -> nn.Module | None:
        return plain_layer_of(self.model, node)

    def visit(self, node: fx.Node, value: Any, taints: dict) -> torch.Tensor | None:
        module = self._module(node)
        if module is None:
            return None
        x = taints[node.args[0]]
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return None
        cols = request_columns(x)
        if not 0 < int(cols.sum()) < cols.numel():
            return None  # all request or all candidate: nothing to split
        path = source_module(node)
        if isinstance(module, nn.LayerNorm):
            self.kept.setdefault(
                path, "LayerNorm over request and candidate lanes mixes their statistics"
            )
            return None
        rows = self._request_rows(path, module, cols)
        if rows is None:
            return None
        if self.sites[path] > 1:
            self.refused[path] = f"called at {self.sites[path]} places; one lane layout needed"
            return None
        request_in = lane_ranges(cols)
        self.plans[path] = (request_in, rows)
        n_rows = sum(b - a for a, b in rows)
        self.described[path] = (
            f"request rows {_span(rows)} ({n_rows}/{module.out_features}) read request columns "
            f"{_span(request_in)} ({int(cols.sum())}/{cols.numel()}); "
            f"{n_rows}x{int((~cols).sum())} block exactly zero"
        )
        taint = x.any(-1, keepdim=True).expand(*x.shape[:-1], module.out_features).clone()
        for a, b in rows:
            taint[..., a:b] = False
        return taint

    def _request_rows(self, path: str, linear: nn.Linear, cols: torch.Tensor) -> Ranges | None:
        """The exactly-zero blocks of ``linear`` on the candidate columns, as row ranges; None
        (and the reason in ``kept`` or ``refused``) when there is none."""
        block = linear.weight.detach()[:, ~cols] == 0
        zero = block.all(1)
        mostly = block.float().mean(1) >= BLOCK_ZERO_SHARE
        accepted, refusals = [], []
        for a, b in lane_ranges(mostly | zero):
            if bool(zero[a:b].all()):
                accepted.append((a, b))
                continue
            nonzero = linear.weight.detach()[a:b][:, ~cols]
            count = int((nonzero != 0).sum())
            refusals.append(
                f"rows {a}:{b} x {int((~cols).sum())} candidate columns: {count} nonzero "
                f"entr{'y' if count == 1 else 'ies'} (largest |w| = "
                f"{float(nonzero.abs().max()):.3g}), not converted"
            )
        if refusals:
            self.refused[path] = "; ".join(refusals)
        if not accepted:
            if not refusals:
                self.kept[path] = "no output row is zero on every candidate column"
            return None
        return tuple(accepted)
