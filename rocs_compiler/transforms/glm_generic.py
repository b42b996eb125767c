"""``apply_glm`` on any model: GLM masks placed where the lanes say.

The model is captured with the compiler's own capture and role analysis, and the lane analysis
(:mod:`rocs_compiler.analysis.segments`) finds, on the example batch, which last-dim columns of every value
depend on request inputs only. Walking the graph in order, every ``nn.Linear`` whose input mixes
request and candidate lanes becomes a :class:`~rocs_compiler.layers.GLMLinear` whose request
outputs read the request columns only, and every such ``nn.LayerNorm`` a
:class:`~rocs_compiler.layers.GroupLayerNorm`. The planner predicts each new layer's output lanes
(its request rows are request lanes) before it visits the layers that read them, so one walk
plans a whole stack; the transformed model is then captured again and the lanes re-derived from
its graph, until no mixed layer is left unplanned.

Output lanes of a GLM layer: ``request_fraction`` of its outputs, first (widened ``request_scale``
times when every reader of the output is another plain ``nn.Linear`` that is rebuilt for the new
width), except when the output meets, through elementwise ops, another value of the same width
with mixed lanes (a residual ``x + W x`` or a cross term ``x0 * W x``): then it takes that
value's lanes, so the product or sum keeps them.

Kept as they were, with the reason in the report: output layers (mixed, but no layer reads their
outputs) and layers that cannot hold both groups. Refused, in the report and in a warning:
modules called at several places, norms over several dims, and parameter
products on mixed lanes inside other module types (``x @ self.weight``, attention projections).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..analysis.driver import analyze, source_module
from ..capture.trace import capture, describe_example
from ..ir.graph_meta import ROLE
from ..analysis.segments import Ranges, lane_ranges, request_columns, run_taints
from .layers import GLMLinear, GroupLayerNorm
from ..analysis.op_groups import TRAILING_NORMS, is_elementwise, packet
from ..ir.roles import Role

__all__ = ["GLMReport", "apply_glm_generic", "infer_example_kwargs"]

aten = torch.ops.aten
_CONTRACTIONS = frozenset(
    {aten.linear, aten.mm, aten.bmm, aten.matmul, aten.addmm, aten.baddbmm, aten.einsum}
)
_MAX_ROUNDS = 4


@dataclass
class GLMReport:
    """What :func:`apply_glm` did, by module path."""

    transformed: dict[str, str] = field(default_factory=dict)  # path -> lanes in -> out
    kept: dict[str, str] = field(default_factory=dict)  # path -> why it stays dense
    refused: dict[str, str] = field(default_factory=dict)  # path -> why it cannot be masked

    def __str__(self) -> str:
        lines = [f"GLM: {len(self.transformed)} layers masked"]
        lines += [f"  {p}: {lanes}" for p, lanes in self.transformed.items()]
        lines += [f"  kept {p}: {why}" for p, why in self.kept.items()]
        lines += [f"  NOT masked {p}: {why}" for p, why in self.refused.items()]
        return "\n".join(lines)


@dataclass(frozen=True)
class _Plan:
    """A layer's replacement: GLM lanes (or only a new input width for a dense layer)."""

    kind: str  # "linear", "dense" or "norm"
    width_in: int
    request_in: Ranges
    width_out: int = 0
    request_out: Ranges = ()

    def build(self, old: nn.Module) -> nn.Module:
        device, dtype = old.weight.device, old.weight.dtype
        n_in = sum(b - a for a, b in self.request_in)
        if self.kind == "norm":
            new = GroupLayerNorm(
                n_in, self.width_in - n_in, eps=old.eps,
                elementwise_affine=old.elementwise_affine, request_lanes=self.request_in,
            )
        elif self.kind == "dense":
            new = nn.Linear(self.width_in, old.out_features, bias=old.bias is not None)
        else:
            n_out = sum(b - a for a, b in self.request_out)
            new = GLMLinear(
                n_in, self.width_in - n_in, n_out, self.width_out - n_out,
                bias=old.bias is not None, request_in=self.request_in, request_out=self.request_out,
            )
        if self.kind != "dense" and self._same_shape(old):
            new.load_state_dict(old.state_dict())
        return new.to(device=device, dtype=dtype)

    def _same_shape(self, old: nn.Module) -> bool:
        if self.kind == "norm":
            return tuple(old.normalized_shape) == (self.width_in,)
        return tuple(old.weight.shape) == (self.width_out, self.width_in)

    def describe(self) -> str:
        n_in = sum(b - a for a, b in self.request_in)
        n_out = sum(b - a for a, b in self.request_out) if self.kind == "linear" else n_in
        out = self.width_out if self.kind == "linear" else self.width_in
        return f"request lanes {n_in}/{self.width_in} -> {n_out}/{out}"


def infer_example_kwargs(model: nn.Module, rows: int = 4) -> dict[str, torch.Tensor]:
    """Example inputs for a model whose every input goes first into an ``nn.Linear``,
    ``nn.Embedding`` or ``nn.EmbeddingBag`` (found with ``torch.fx.symbolic_trace``)."""
    name = type(model).__name__
    hint = "pass example_kwargs= (one replicated example batch)"
    try:
        traced = fx.symbolic_trace(model)
    except Exception as err:
        raise ValueError(f"apply_glm: cannot infer the inputs of {name} ({err}); {hint}") from err
    examples = {}
    for ph in (n for n in traced.graph.nodes if n.op == "placeholder"):
        first = next(iter(ph.users), None)
        module = (
            traced.get_submodule(first.target)
            if first is not None and first.op == "call_module" and first.args[:1] == (ph,)
            else None
        )
        if isinstance(module, nn.Linear):
            examples[ph.target] = torch.randn(rows, module.in_features)
        elif isinstance(module, nn.Embedding):
            examples[ph.target] = torch.randint(0, module.num_embeddings, (rows,))
        elif isinstance(module, nn.EmbeddingBag):
            examples[ph.target] = torch.randint(0, module.num_embeddings, (rows, 2))
        else:
            raise ValueError(  # noqa: TRY004 - a missing example, not a wrong type
                f"apply_glm: cannot infer the shape of {name}'s input {ph.target!r} "
                f"(its first use is not a Linear or an embedding); {hint}"
            )
    return examples


def apply_glm_generic(
    model: nn.Module,
    request_inputs: Sequence[str],
    lanes: Any,
    example_args: tuple = (),
    example_kwargs: Mapping[str, Any] | None = None,
) -> nn.Module:
    """The GLM form of ``model`` (a deep copy), with a :class:`GLMReport` as ``rocs_glm_report``.

    ``lanes`` is a :class:`~rocs_compiler.transforms.glm.Lanes` (fraction and scale).
    """
    if example_kwargs is None and not example_args:
        example_kwargs = infer_example_kwargs(model)
    new = copy.deepcopy(model).eval()
    originals: dict[str, nn.Module] = {}
    report = GLMReport()
    for _ in range(_MAX_ROUNDS):
        planner = _Planner(new, lanes)
        planner.run(request_inputs, example_args, example_kwargs or {})
        report.kept, report.refused = planner.kept, planner.refused
        if not planner.plans:
            break
        for path, plan in planner.plans.items():
            originals.setdefault(path, new.get_submodule(path))
            new.set_submodule(path, plan.build(originals[path]))
            if plan.kind != "dense":
                report.transformed[path] = plan.describe()
    if report.refused:
        listed = "; ".join(f"{p}: {why}" for p, why in report.refused.items())
        warnings.warn(f"apply_glm: {len(report.refused)} layer(s) left unmasked: {listed}")
    new.rocs_glm_report = report
    return new.train(model.training)


def _is_rocs_layer(module: nn.Module) -> bool:
    return any(c.__module__.startswith("rocs_compiler.") for c in type(module).__mro__)


def _mixed(taint: Any) -> torch.Tensor | None:
    """The request columns of a tensor taint when it has both kinds of lanes, else None."""
    if not isinstance(taint, torch.Tensor) or taint.dim() == 0:
        return None
    cols = request_columns(taint)
    return cols if 0 < int(cols.sum()) < cols.numel() else None


class _Planner:
    """One walk over the captured model: plans for the plain layers whose inputs are mixed."""

    def __init__(self, model: nn.Module, lanes: Any):
        self.model, self.lanes = model, lanes
        self.taints: dict = {}
        self.plans: dict[str, _Plan] = {}
        self.kept: dict[str, str] = {}
        self.refused: dict[str, str] = {}

    def run(self, request_inputs, example_args, example_kwargs) -> None:
        call = describe_example(self.model, example_args, example_kwargs, list(request_inputs))
        cg = capture(self.model, example_args, example_kwargs, list(request_inputs))
        gm = cg.graph_module
        analyze(gm, {cg.placeholder_of[n] for n in cg.request_inputs}, cg.batch_symbol)
        self.sites: dict[str, list[fx.Node]] = {}
        for node in gm.graph.nodes:
            if self._module(node) is not None:
                self.sites.setdefault(source_module(node), []).append(node)
        self.feeds = _feeds_contraction(gm)
        run_taints(gm, [call.leaves[n] for n in cg.input_names], self.visit)

    def _module(self, node: fx.Node) -> nn.Module | None:
        return plain_layer_of(self.model, node)

    def visit(self, node: fx.Node, value: Any, taints: dict) -> torch.Tensor | None:
        self.taints = taints
        module = self._module(node)
        if module is None:
            self._check_unsupported(node, taints)
            return None
        x = taints[node.args[0]]
        path, width = source_module(node), x.shape[-1]
        cols = _mixed(x)
        if cols is None:
            if isinstance(module, nn.Linear) and width != module.in_features:
                self.plans[path] = _Plan("dense", width, ())
                return _dense(x, module.out_features)
            return None
        if len(self.sites[path]) > 1:
            self.refused[path] = f"called at {len(self.sites[path])} places; one lane layout needed"
            return None
        if isinstance(module, nn.LayerNorm):
            return self._norm(node, module, path, x, cols)
        return self._linear(node, module, path, x, cols)

    def _linear(self, node, module, path, x, cols) -> torch.Tensor | None:
        width, out = x.shape[-1], module.out_features
        if not self.feeds[node]:
            self.kept[path] = "output layer: no layer reads its outputs"
            if width != module.in_features:
                self.plans[path] = _Plan("dense", width, ())
            return _dense(x, out)
        if out < 2:
            self.refused[path] = f"{out} output cannot hold a request and a candidate lane"
            return None
        request_out = _meet(node, out, self.taints)
        width_out = out
        if request_out is None:
            scale = 1.0 if not self._widenable(node) else self.lanes.scale
            n_req, n_cand = type(self.lanes)(self.lanes.fraction, scale).split(out)
            request_out, width_out = ((0, n_req),), n_req + n_cand
        plan = _Plan("linear", width, lane_ranges(cols), width_out, request_out)
        self.plans[path] = plan
        taint = _dense(x, width_out)
        for a, b in request_out:
            taint[..., a:b] = False
        return taint

    def _norm(self, node, module, path, x, cols) -> torch.Tensor | None:
        if len(module.normalized_shape) != 1:
            self.refused[path] = "LayerNorm over several dims with mixed lanes"
            return None
        self.plans[path] = _Plan("norm", x.shape[-1], lane_ranges(cols))
        taint = x.clone()
        taint[..., cols] = False
        taint[..., ~cols] = x[..., ~cols].any(-1, keepdim=True)
        return taint

    def _widenable(self, node: fx.Node) -> bool:
        """Every reader (through one-input elementwise ops) is a plain Linear called once."""
        for user in node.users:
            if packet(user.target) is aten.linear and user.args[0] is node:
                module = self._module(user)
                if module is None or len(self.sites[source_module(user)]) != 1:
                    return False
            elif user.op == "call_function" and is_elementwise(user.target):
                if len(user.all_input_nodes) != 1 or not self._widenable(user):
                    return False
            else:
                return False
        return True

    def _check_unsupported(self, node: fx.Node, taints: dict) -> None:
        """Record a parameter product or norm on mixed lanes that no plan covers."""
        family = packet(node.target) if node.op == "call_function" else None
        if family not in _CONTRACTIONS and family not in TRAILING_NORMS:
            return
        inputs = node.all_input_nodes
        if not any(n.meta.get(ROLE) == Role.CONST for n in inputs):
            return
        if not any(_mixed(taints.get(n)) is not None for n in inputs):
            return
        path = source_module(node)
        try:
            module = self.model.get_submodule(path)
        except AttributeError:
            module = None
        if module is not None and _is_rocs_layer(module):
            return
        kind = type(module).__name__ if module is not None else "the model's forward"
        self.refused.setdefault(
            path or node.name,
            f"{family.__name__} with parameters on mixed lanes in {kind}: "
            "apply_glm masks nn.Linear and nn.LayerNorm only",
        )


def _dense(x: torch.Tensor, width: int) -> torch.Tensor:
    """The taint of a dense map of ``x``'s last dim to ``width`` outputs."""
    return x.any(-1, keepdim=True).expand(*x.shape[:-1], width).clone()


def _meet(node: fx.Node, width: int, taints: dict) -> Ranges | None:
    """The lanes of a mixed value of the same width that ``node``'s output meets elementwise."""
    current = node
    while len(current.users) == 1:
        user = next(iter(current.users))
        if user.op != "call_function" or not is_elementwise(user.target):
            return None
        for other in user.all_input_nodes:
            taint = taints.get(other)
            if other is not current and isinstance(taint, torch.Tensor) and taint.dim() > 0:
                cols = _mixed(taint) if taint.shape[-1] == width else None
                return None if cols is None else lane_ranges(cols)
        current = user
    return None


def _feeds_contraction(gm: fx.GraphModule) -> dict[fx.Node, bool]:
    """Per node: does its value reach a contraction (a layer that reads it)?"""
    feeds: dict[fx.Node, bool] = {}
    for node in reversed(list(gm.graph.nodes)):
        feeds[node] = any(
            (u.op == "call_function" and packet(u.target) in _CONTRACTIONS) or feeds.get(u, False)
            for u in node.users
        )
    return feeds


def plain_layer_of(model: nn.Module, node: fx.Node) -> nn.Module | None:
    """The plain ``nn.Linear`` or ``nn.LayerNorm`` of ``model`` whose call ``node`` is."""
    if node.op != "call_function":
        return None
    op = packet(node.target)
    if op not in (aten.linear, aten.layer_norm):
        return None
    try:
        module = model.get_submodule(source_module(node))
    except AttributeError:
        return None
    wanted = nn.Linear if op is aten.linear else nn.LayerNorm
    return module if type(module) is wanted else None

