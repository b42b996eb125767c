"""defer: push request-candidate interactions as late as algebra allows.

A concatenation of request and candidate pieces is where the two sides meet. Two identities
move that meeting point later, so that more of the graph stays request-only:

1. *Contraction over the concatenated axis splits into a sum.* For a weight W whose columns
   are split like the pieces, ``linear(cat(u, c), W, b) == linear(u, W_u) + linear(c, W_c, b)``;
   the same holds for ``matmul(W, cat(u, c, dim=-2))`` (linear compression), einsum contracting
   the concatenated letter, and ``sum`` over the concatenated dim. ``linear(u, W_u)`` is
   request-only and runs once per request.
2. *Ops independent along the concatenated axis distribute over it.*
   ``f(cat(u, c, d)) == cat(f(u), f(c), d')`` for elementwise ops (other operands sliced along
   d), linear maps and matmuls on other dims, norms and softmaxes over other dims, reductions
   over other dims, reshapes/permutes that keep the axis intact, and reshapes that split it
   into whole pieces (``[B, F*D] -> [B, F, D]``). ``f(u)`` is request-only.
   Applied repeatedly this computes K/V projections of a request history once per request, and
   turns a pairwise interaction ``bmm(T, T^T)`` over a stacked request/candidate feature set
   into blocks whose request-request block runs once per request.

Both rules fire only on *mixed* concatenations (at least one request piece and one that is
not); the re-association of sums they introduce is the only numerical difference.

Precision of the split sums: eager contracts a float16/bfloat16 tensor with a float32
accumulator and rounds once; two low-precision partials added in low precision round three
times (about one ulp of the partials' scale). With ``float32_partials`` (the default) rule 1
computes a low-precision contraction's partials in float32 and rounds their sum once, which
matches eager up to float32 re-association (bit for bit in practice). float32 and float64
contractions split in their own dtype: the partials' re-association is the bound (a few ulps
of ``sum |terms|``).

The identities live one module each: ``defer_split.py`` (1, with the float32 partials),
``defer_distribute.py`` (2), ``defer_reshape.py`` (2 for reshapes) and ``defer_select.py`` (2 for
constant advanced indexing). This module lists them in the order the engine tries them and runs
them with the normalizations to a fixpoint.
"""

from __future__ import annotations

import sympy
from torch import fx

from ..analysis.driver import infer_node
from .defer_distribute import distribute_rewrites
from .defer_select import select_rewrites
from .defer_split import split_rewrites
from .engine import Rewrite, rewrite_to_fixpoint
from .normalize import normalize_rewrites


def defer_rewrites(float32_partials: bool = True) -> list[Rewrite]:
    """The defer rewrites, splits first; ``float32_partials``: see the module docstring
    (precision)."""
    return split_rewrites(float32_partials) + distribute_rewrites() + select_rewrites()


def defer(
    gm: fx.GraphModule,
    request_placeholders: set[str],
    symbol: sympy.Symbol,
    float32_partials: bool = True,
):
    """Normalize, then apply the defer identities to a fixpoint. Returns (graph, counts)."""

    def infer(node: fx.Node) -> None:
        infer_node(node, request_placeholders, symbol)

    rewrites = normalize_rewrites() + defer_rewrites(float32_partials)
    counts = rewrite_to_fixpoint(gm, rewrites, infer)
    return gm, counts
