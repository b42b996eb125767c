"""FLOP counts per node, split into a per-row part and a fixed part.

Every node of the logical graph is run on fake tensors at two concrete batch sizes under
``FlopCounterMode``; since a node's cost is affine in the batch size, the difference gives the
cost per row (per request for REQUEST nodes, per candidate for CANDIDATE nodes) and the rest is
the fixed cost. PyTorch counts matmuls, convolutions and (with the formulas registered here)
attention; elementwise work is not counted, as is customary.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

_BATCHES = (2, 4)


def _register_missing_formulas() -> None:
    """CPU attention and LSTM kernels have no formula in PyTorch's counter; use the standard
    ones (an RNN layer: one input and one recurrent matmul per step and row)."""
    aten = torch.ops.aten
    op = aten._scaled_dot_product_flash_attention_for_cpu
    if op in flop_counter.flop_registry or op.default in flop_counter.flop_registry:
        return

    @flop_counter.register_flop_formula(op)
    def _sdpa_cpu(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    @flop_counter.register_flop_formula(aten.mkldnn_rnn_layer)
    def _rnn_layer(input_shape, w_ih_shape, w_hh_shape, *args, out_shape=None, **kwargs) -> int:
        steps_and_rows = math.prod(input_shape[:-1])
        return 2 * steps_and_rows * (math.prod(w_ih_shape) + math.prod(w_hh_shape))


_register_missing_formulas()


@dataclass(frozen=True)
class NodeCost:
    per_row: float
    fixed: float


def _concrete(value: Any, sizes: dict) -> Any:
    """A size at ``sizes``; any other size symbol at the value it had in the example (a history
    length marked dynamic); a data-dependent size (``nonzero``'s count, say), which has none, is
    estimated by its upper bound for row selections: the batch size."""
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        unknown = expr.free_symbols - sizes.keys()
        if not unknown:
            return int(expr.subs(sizes))
        batch = next(iter(sizes.values()))
        env = value.node.shape_env  # torch >= 2.13 names the example's values backed_var_to_val
        hints = getattr(env, "backed_var_to_val", None)
        if hints is None:
            hints = getattr(env, "var_to_val", {})
        return int(expr.subs(sizes).subs({u: hints.get(u, batch) for u in unknown}))
    return value


def _fake_input(val: torch.Tensor, sizes: dict, mode: FakeTensorMode) -> torch.Tensor:
    shape = [_concrete(s, sizes) for s in val.shape]
    with mode:
        return torch.zeros(shape, dtype=val.dtype, device=val.device)


def _fake_like(val: Any, sizes: dict, mode: FakeTensorMode) -> Any:
    """A node's recorded value (``meta["val"]``) as a fake value at ``sizes``."""
    if isinstance(val, torch.Tensor):
        return _fake_input(val, sizes, mode)
    if isinstance(val, (list, tuple)):
        return type(val)(_fake_like(v, sizes, mode) for v in val)
    return _concrete(val, sizes)


def flops_at(gm: fx.GraphModule, sizes: dict) -> dict[str, int]:
    """FLOPs of every call node of ``gm`` (a graph module, or an exported program: its
    ``get_attr`` nodes, a ``torch.cond``'s branches, are its graph module's) with its size symbols
    set to ``sizes``, on fake tensors."""
    owner = getattr(gm, "graph_module", gm)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    env: dict[fx.Node, Any] = {}
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            env[node] = _fake_input(val, sizes, mode) if isinstance(val, torch.Tensor) else _concrete(val, sizes)
        elif node.op == "get_attr":
            obj = operator.attrgetter(node.target)(owner)
            env[node] = mode.from_tensor(obj) if isinstance(obj, torch.Tensor) else obj
        elif node.op == "call_function":
            args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: env[a])
            try:
                with mode, FlopCounterMode(display=False) as counter:
                    env[node] = node.target(*args, **kwargs)
                counts[node.name] = counter.get_total_flops()
            except DynamicOutputShapeException:
                # Output size depends on values (nonzero, masked_select): no FLOPs of its own.
                env[node] = _fake_like(node.meta.get("val"), sizes, mode)
                counts[node.name] = 0
    return counts


def node_costs(
    gm: fx.GraphModule, symbol: sympy.Symbol, lengths: dict | None = None
) -> dict[str, NodeCost]:
    """Per-node cost as ``per_row * batch + fixed``, with the other size symbols at ``lengths``
    (``{symbol: size}``; a symbol not given keeps the example's value)."""
    low, high = (flops_at(gm, {symbol: b, **(lengths or {})}) for b in _BATCHES)
    span = _BATCHES[1] - _BATCHES[0]
    out = {}
    for name, f_low in low.items():
        per_row = (high[name] - f_low) / span
        out[name] = NodeCost(per_row=per_row, fixed=f_low - per_row * _BATCHES[0])
    return out
