"""The cost of one call of a shared graph, as sympy expressions over the call's sizes.

A shared graph (the one ``cm(...)`` runs in shared layout) has one batch symbol in its fake
values: a node placed REQUEST holds R rows, a node placed CANDIDATE holds N rows
(``ir/graph_meta.py``, ``PLACEMENT``). The walk here builds each input again on fake tensors of a
fresh shape environment whose sizes are the symbols ``R`` and ``N`` (by the input's placement)
and ``L_<input>`` for each dynamic length, and runs every node on them once: PyTorch's FLOP
counter (with the formulas of ``analysis/flops.py`` and of each ``rocs::`` op) then returns each
node's FLOPs as an expression, and the fake values its bytes.

Identity relied on: every size in the graph is a polynomial in the batch symbol and the
lengths, and the shared program computes a REQUEST node at R rows and a CANDIDATE node at N
rows; so running the graph on inputs of R and N rows gives every node its size at the call.

Per node it records an *op family* (``gemm``, ``bmm``, ``attention``, ``gather``, ``memory``,
``view``) and its counts: one launch, FLOPs, bytes moved (inputs read plus outputs written; a
gather reads only the rows it gathers, a view moves nothing), items (matrices of a batched
product, but for matrix-vector products; query rows of an attention; rows of a gather: work
each costs by itself) and bytes allocated for its outputs (none for an op the program runs in
place). A calibration (``runtime/program/calibration.py``) gives seconds per unit of each;
:func:`node_seconds` is the one formula that turns counts into seconds, for a graph's nodes and
for the calibration's own fit alike.
"""

from __future__ import annotations

import functools
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Optional, Sequence

import sympy
import torch
from torch import fx
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from ..ir.graph_meta import INDEX_NAME, PLACEMENT
from ..ir.roles import Role
from . import flops as _flops  # noqa: F401  (registers the CPU attention and RNN formulas)

FAMILIES = ("gemm", "bmm", "attention", "gather", "memory", "view")
# Counts with a rate of their own per family (``Rates``); ``allocated`` (bytes of the outputs an
# op allocates) is read by the memory terms of :func:`node_seconds`.
COUNTS = ("ops", "flops", "bytes", "items")
ALL_COUNTS = (*COUNTS, "allocated")

_GEMM = {
    "aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::einsum",
    "aten::convolution", "aten::conv1d", "aten::conv2d", "aten::mkldnn_rnn_layer", "aten::lstm",
    "aten::gru", "aten::rnn_tanh", "aten::rnn_relu", "rocs::broadcast_linear",
    "rocs::broadcast_linear_compression",
}  # fmt: skip
# Products of many small matrices, one per leading index: each costs by itself (``items``).
_BATCHED = {"aten::bmm", "aten::baddbmm", "aten::addbmm", "rocs::broadcast_interaction"}
_ATTENTION = {
    "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_attention_math", "rocs::broadcast_attention",
}  # fmt: skip
# Gathers: name -> position of the index argument; a bag pools the rows it gathers.
_GATHER = {
    "aten::embedding": 1, "aten::index_select": 2, "aten::index": 1, "aten::gather": 2,
    "aten::take": 1,
}  # fmt: skip
_BAGS = {"aten::embedding_bag": 1, "aten::_embedding_bag": 1, "rocs::embedding_bag_rows": 1}


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> Any:
    return t.numel() * t.element_size()


def op_family(target: Any, args: tuple, out: Any) -> Optional[str]:
    """The family of a call of ``target`` on ``args`` that returned ``out``; None for what
    launches no op (Python on sizes, tuple items)."""
    schema = getattr(target, "_schema", None)
    if schema is None or schema.name == "aten::sym_size":
        return None
    name = schema.name
    if name == "aten::matmul" and all(t.dim() > 2 for t in _tensors(args)):
        return "bmm"  # [B, m, k] @ [B, k, n]: a 2-D operand would make it one GEMM
    if name in _GEMM:
        return "gemm"
    if name in _BATCHED:
        return "bmm"
    if name in _ATTENTION:
        return "attention"
    if name in _GATHER or name in _BAGS:
        return "gather"
    aliases = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
    outputs = _tensors(out)
    if aliases and outputs and all(t._is_view() for t in outputs):
        return "view"
    return "memory"


def op_counts(target: Any, args: tuple, kwargs: dict, out: Any, flops: Any) -> dict[str, Any]:
    """``{count: value}`` for :data:`ALL_COUNTS` of one call of ``target`` (an ``OpOverload``)
    on ``args``/``kwargs`` that returned ``out``; sizes may be symbolic. The same counts serve a
    node of a graph (:func:`call_cost`) and a timed call of the calibration."""
    family = op_family(target, args, out)
    counts = {"ops": 1, "flops": flops, "bytes": 0, "items": 0, "allocated": 0}
    if family == "view":
        return counts
    name = target._schema.name
    inputs, outputs = _tensors((args, kwargs)), _tensors(out)
    written = counts["allocated"] = sum(_nbytes(t) for t in outputs)
    if family == "gather":
        index = _tensors(args[(_GATHER | _BAGS)[name]])
        rows = sum(t.numel() for t in index)
        if name in _BAGS:
            table = args[0]
            read = rows * math.prod(table.shape[1:]) * table.element_size()
        else:
            read = written
        counts.update(bytes=read + written + sum(_nbytes(t) for t in index), items=rows)
        return counts
    counts["bytes"] = sum(_nbytes(t) for t in inputs) + written
    if family == "bmm" and outputs and outputs[0].shape[-1] != 1:
        counts["items"] = math.prod(outputs[0].shape[:-2])  # a matrix-vector product: none
    elif family == "attention" and inputs:
        counts["items"] = math.prod(inputs[0].shape[:-1])
    return counts


# Ops whose cost per count depends on a non-tensor argument: schema name -> the variant a call's
# arguments name, or "" for the op's plain form. A variant has rates of its own in a calibration
# that measured it (``Calibration.rates`` falls back to the op's, then to its family's).
_VARIANTS = {
    # ``(weight, indices, mode, padding_idx)``: a mean divides each bag by its count, and with a
    # padding index ATen drops the padded entries one by one; either costs 2-3x a plain sum.
    "rocs::embedding_bag_rows": lambda args: ",".join(
        name for name, on in (("mean", args[2] == 1), ("padded", args[3] is not None)) if on
    ),
    # ``(query, key, value, ...)``: heads of at most 8 numbers do a fraction of the FLOPs of the
    # 32-wide heads the family is measured at for about the same work per query row.
    "aten::scaled_dot_product_attention": lambda args: (
        "narrow" if _static_width(args[0]) <= NARROW_HEAD else ""
    ),
    # ``(input, normalized_shape, weight, bias, eps)``: without a weight ATen's CPU kernel takes
    # a slower path (1.4x at 64 wide), so models' affine norms are the op's plain form.
    "aten::layer_norm": lambda args: "" if len(args) > 2 and args[2] is not None else "unscaled",
}
NARROW_HEAD = 8  # the widest head of an attention's "narrow" variant


def _static_width(query: Any) -> float:
    """The last dim of ``query`` where it is a number (a head's width), else infinity."""
    width = query.shape[-1] if isinstance(query, torch.Tensor) and query.dim() else None
    return int(width) if isinstance(width, int) else float("inf")


def op_key(target: Any, args: tuple) -> str:
    """The name a calibration keys ``target``'s rates by for a call on ``args``: its schema name,
    with the variant in brackets for an op of :data:`_VARIANTS`
    (``rocs::embedding_bag_rows[mean]``)."""
    name = target._schema.name
    variant = _VARIANTS[name](args) if name in _VARIANTS else ""
    return f"{name}[{variant}]" if variant else name


def _positive(x: Any) -> Any:
    return sympy.Max(0, x) if isinstance(x, sympy.Basic) else max(0.0, x)


def _if_at_least(x: Any, threshold: float, value: Any = None) -> Any:
    """``value`` (default ``x``) where ``x >= threshold``, else 0."""
    value = x if value is None else value
    if isinstance(x, sympy.Basic) or isinstance(value, sympy.Basic):
        return sympy.Piecewise((value, sympy.sympify(x) >= threshold), (0, True))
    return value if x >= threshold else 0.0


def _streamed_per_byte(nbytes: Any, points: Sequence[tuple[float, float]]) -> Any:
    """Extra seconds per byte of a GEMM of ``nbytes`` (a number or an expression): linear
    between ``points`` (bytes, seconds per byte; bytes rising), 0 below the first, the last's
    past it."""
    pieces = [(sympy.Integer(0), nbytes < points[0][0])]
    pieces += [(e0 + (e1 - e0) * (nbytes - b0) / (b1 - b0), nbytes < b1)
               for (b0, e0), (b1, e1) in zip(points, points[1:])]  # fmt: skip
    pieces.append((points[-1][1], True))
    if isinstance(nbytes, sympy.Basic):
        return sympy.Piecewise(*pieces)
    return float(next(value for value, below in pieces if below))


# glibc maps an allocation of more than 32 MiB (its largest mmap threshold, on 64-bit machines)
# afresh from the kernel each time and unmaps it when freed.
MAPPED_BYTES = 32 * 2**20 + 1


def node_seconds(family: str, counts: Mapping[str, Any], rates, calibration) -> Any:
    """Seconds of one op of ``family`` with ``counts`` (:func:`op_counts`; numbers or
    expressions): each count times its rate (``rates``: seconds per launch, FLOP, byte and item
    of the family or of the op itself, measured on an op repeated in cache), plus what an op
    pays in a program and not repeated in cache (``calibration``): ``launch_s`` per launch (the
    interpreter and the op's code no longer warm), bytes past what the caches hold
    (``cache_bytes``) at ``spill_s`` each, an output of at least ``fresh_bytes`` (pages the
    allocator hands out afresh, faulted in on first write) at ``fresh_s`` per byte and one of
    at least :data:`MAPPED_BYTES` at ``mapped_s`` more, a gathered row of a table that other
    work evicted from the caches at ``cold_row_s``, and a byte of a GEMM whose operands no
    longer fit in the caches at what ``streamed`` gives for its size."""
    seconds = sum(counts[c] * getattr(rates, f"{c}_s") for c in COUNTS)
    seconds += counts["ops"] * calibration.launch_s
    seconds += _positive(counts["bytes"] - calibration.cache_bytes) * calibration.spill_s
    allocated = counts["allocated"]
    seconds += _if_at_least(allocated, calibration.fresh_bytes) * calibration.fresh_s
    seconds += _if_at_least(allocated, MAPPED_BYTES) * calibration.mapped_s
    if family == "gather":
        seconds += counts["items"] * calibration.cold_row_s
    elif family == "gemm" and calibration.streamed:
        seconds += counts["bytes"] * _streamed_per_byte(counts["bytes"], calibration.streamed)
    return seconds


@dataclass(frozen=True)
class Counts:
    """Numbers: FLOPs, bytes and ops launched of a call (or of one request, ``ops`` 0)."""

    flops: float
    bytes: float
    ops: int


@dataclass(frozen=True)
class OpTerm:
    """One launched op of the graph: its node, family, op (schema name, with its variant:
    :func:`op_key`) and ``{count: expression}`` for :data:`ALL_COUNTS`."""

    node: str
    family: str
    op: str
    counts: dict[str, sympy.Expr]


@dataclass(frozen=True)
class CallCost:
    """The cost of one shared-layout call, as expressions over ``R``, ``N`` and the length
    symbols (``lengths``: input name -> its symbol; inputs that share one length share its
    symbol, named after the first of them): one :class:`OpTerm` per launched op."""

    terms: tuple[OpTerm, ...]
    R: sympy.Symbol
    N: sympy.Symbol
    lengths: dict[str, sympy.Symbol] = field(default_factory=dict)
    example_lengths: dict[sympy.Symbol, int] = field(default_factory=dict)

    @property
    def families(self) -> dict[str, dict[str, sympy.Expr]]:
        """``{family: {count: expression}}``, the terms summed per family."""
        out: dict[str, dict[str, sympy.Expr]] = {}
        for term in self.terms:
            into = out.setdefault(term.family, {c: sympy.Integer(0) for c in ALL_COUNTS})
            for count, value in term.counts.items():
                into[count] = sympy.expand(into[count] + value)
        return out

    def total(self, count: str) -> sympy.Expr:
        return sympy.expand(sum((t.counts[count] for t in self.terms), sympy.Integer(0)))

    @property
    def flops(self) -> sympy.Expr:
        return self.total("flops")

    @property
    def bytes(self) -> sympy.Expr:
        return self.total("bytes")

    @property
    def ops(self) -> int:
        """Ops launched per call, views included."""
        return len(self.terms)

    @property
    def symbols(self) -> tuple[sympy.Symbol, ...]:
        return (self.R, self.N, *dict.fromkeys(self.lengths.values()))

    def sizes(self, R: int, N: int, **lengths: int) -> dict[sympy.Symbol, int]:
        """``{symbol: size}`` of a call; a length is named by its input (``hist_item_ids=50``)
        or its symbol (``L_hist_item_ids=50``); one not given keeps the example's length."""
        by_name = {**self.lengths, **{str(s): s for s in self.lengths.values()}}
        unknown = sorted(set(lengths) - by_name.keys())
        if unknown:
            known = ", ".join(sorted(by_name)) or "none"
            raise ValueError(f"no dynamic length named {', '.join(unknown)}; lengths: {known}")
        sizes = {**self.example_lengths, self.R: int(R), self.N: int(N)}
        sizes.update({by_name[name]: int(size) for name, size in lengths.items()})
        return sizes

    @functools.cached_property
    def _numeric(self):
        """Every term's counts as one numeric function of the symbols (rows: terms)."""
        table = [[t.counts[c] for c in ALL_COUNTS] for t in self.terms]
        return sympy.lambdify(self.symbols, table, modules="math")

    def counts_at(self, R: int, N: int, **lengths: int) -> list[dict[str, float]]:
        """Every term's counts at a call's sizes, in the order of :attr:`terms`."""
        sizes = self.sizes(R, N, **lengths)
        rows = self._numeric(*(sizes[s] for s in self.symbols))
        return [dict(zip(ALL_COUNTS, map(float, row))) for row in rows]

    def at(self, R: int, N: int, **lengths: int) -> Counts:
        """FLOPs, bytes and ops launched of a call of R requests and N candidates."""
        rows = self.counts_at(R, N, **lengths)
        return Counts(sum(r["flops"] for r in rows), sum(r["bytes"] for r in rows), self.ops)

    def per_request(self, L: Optional[int] = None, k: int = 1) -> Counts:
        """What one request with history length ``L`` (every length; None: the example's) and
        ``k`` candidates adds to a call: ``cost(R=1, N=k) - cost(R=0, N=0)``. What a call pays
        once (its weights read, its launches) is the call's, so ``ops`` is 0."""
        lengths = {} if L is None else {str(s): L for s in set(self.lengths.values())}
        one, none = self.at(1, k, **lengths), self.at(0, 0, **lengths)
        return Counts(one.flops - none.flops, one.bytes - none.bytes, 0)

    def seconds(self, calibration) -> sympy.Expr:
        """Predicted seconds of a call as an expression (:func:`node_seconds` per term, with
        the rates of its op where the calibration measured the op by itself, else of its
        family), plus the calibration's per-call overhead ``call_s``."""
        total = sympy.Float(calibration.call_s)
        for term in self.terms:
            rates = calibration.rates(term.family, term.op)
            total += node_seconds(term.family, term.counts, rates, calibration)
        return total

    def predict_ms(self, calibration, R: int, N: int, **lengths: int) -> float:
        """Predicted milliseconds of a shared-layout call of R requests and N candidates on the
        machine ``calibration`` measured (:meth:`seconds` at those sizes)."""
        seconds = calibration.call_s
        for term, counts in zip(self.terms, self.counts_at(R, N, **lengths)):
            rates = calibration.rates(term.family, term.op)
            seconds += node_seconds(term.family, counts, rates, calibration)
        return 1e3 * seconds


def _symbol_name(input_name: str) -> str:
    return "L_" + re.sub(r"\W", "_", input_name)


class _Sizes:
    """A fresh shape environment whose symbols stand for R, N and the lengths, and the
    translations between its symbols and the cost's."""

    def __init__(self, hints: Mapping[sympy.Symbol, int]):
        from torch._dynamo.source import ConstantSource

        self.env = ShapeEnv()
        self.mode = FakeTensorMode(shape_env=self.env, allow_non_fake_inputs=True)
        self.hints = dict(hints)
        self.to_env, self.from_env = {}, {}
        for symbol, hint in hints.items():
            source = ConstantSource(str(symbol))
            inner = self.env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC)
            self.to_env[symbol], self.from_env[inner] = inner, symbol

    def symint(self, expr: sympy.Expr) -> Any:
        expr = sympy.sympify(expr)
        if not expr.free_symbols:
            return int(expr)
        hint = int(expr.subs(self.hints))
        return self.env.create_symintnode(expr.xreplace(self.to_env), hint=hint)

    def expr(self, value: Any) -> sympy.Expr:
        if isinstance(value, torch.SymInt):
            return sympy.expand(sympy.sympify(value.node.expr).xreplace(self.from_env))
        return sympy.Integer(int(value))


def call_cost(
    gm: fx.GraphModule, placeholder_of: Mapping[str, str], in_place: Collection[str] = ()
) -> CallCost:
    """The :class:`CallCost` of ``gm``, a shared graph whose inputs ``placeholder_of`` names
    (input name -> placeholder name, ``CompiledModel.placeholder_of``); the nodes named in
    ``in_place`` write into an operand's memory and allocate nothing."""
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    index = placeholders[INDEX_NAME].meta["val"]
    batch = index.shape[0].node.expr
    R = sympy.Symbol("R", integer=True, nonnegative=True)
    N = sympy.Symbol("N", integer=True, nonnegative=True)
    lengths, of_length, hints = {}, {}, {R: 3, N: 11}
    for name, target in placeholder_of.items():
        val = placeholders[target].meta.get("val") if target in placeholders else None
        for size in getattr(val, "shape", ())[1:]:
            if not isinstance(size, torch.SymInt) or batch in size.node.expr.free_symbols:
                continue
            inner = size.node.expr
            if inner not in of_length:
                of_length[inner] = sympy.Symbol(_symbol_name(name), integer=True, positive=True)
                hints[of_length[inner]] = int(size.node.hint)
            lengths.setdefault(name, of_length[inner])
    sizes = _Sizes(hints)

    def rebuilt(val: Any, rows: sympy.Symbol) -> Any:
        """A recorded value at the call's sizes: the batch symbol at ``rows``, lengths at theirs,
        any other symbol (a data-dependent size) at ``rows`` too, its upper bound for a row
        selection."""
        if isinstance(val, (list, tuple)):
            return type(val)(rebuilt(v, rows) for v in val)
        if isinstance(val, torch.SymInt):
            expr = val.node.expr.xreplace({batch: rows, **of_length})
            return sizes.symint(expr.xreplace({s: rows for s in expr.free_symbols - hints.keys()}))
        if not isinstance(val, torch.Tensor):
            return val
        shape = [rebuilt(s, rows) for s in val.shape]
        with sizes.mode:
            return torch.empty(shape, dtype=val.dtype, device=val.device)

    terms = []
    env: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        rows = R if node.meta.get(PLACEMENT) is Role.REQUEST else N
        if node.op == "placeholder":
            env[node] = rebuilt(node.meta.get("val"), rows)
        elif node.op == "get_attr":
            obj = operator.attrgetter(node.target)(gm)
            if isinstance(obj, torch.Tensor):
                obj = sizes.mode.from_tensor(obj, static_shapes=True)
            env[node] = obj
        elif node.op == "call_function":
            args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: env[a])
            try:
                with sizes.mode, FlopCounterMode(display=False) as counter:
                    env[node] = node.target(*args, **kwargs)
                flops = counter.get_total_flops()
            except DynamicOutputShapeException:
                env[node] = rebuilt(node.meta.get("val"), rows)
                flops = 0
            except Exception as error:
                raise RuntimeError(f"cost of node {node.name} ({node.target}): {error}") from error
            family = op_family(node.target, args, env[node])
            if family is not None:
                counts = op_counts(node.target, args, kwargs, env[node], flops)
                if node.name in in_place:
                    counts["allocated"] = 0
                counts = {c: sizes.expr(v) for c, v in counts.items()}
                terms.append(OpTerm(node.name, family, op_key(node.target, args), counts))
    example = {symbol: hints[symbol] for symbol in of_length.values()}
    return CallCost(tuple(terms), R, N, lengths, example)
