"""ATen op families: what the compiler knows about an op as a member of a family, said once.

The role rules (``role_rules.py``), defer's distribution over concatenations
(``passes/defer.py``), in-place planning in the runtime (``runtime/program/inplace.py``) and the
pointwise program language (``kernels/pointwise_program.py``) all ask the questions below; none
keeps its own list of ops. Adding an op to a family here adds it everywhere at once.

Families are sets of overload packets (``aten.add``), or predicates over a call target (an
``OpOverload`` or a packet):

- :func:`is_elementwise`: ``out[i] = f(x[i], y[i], ...)`` under ordinary broadcasting, with no
  randomness and no mutation. Every op tagged ``torch.Tag.pointwise`` plus
  ``ELEMENTWISE_UNTAGGED`` (ops that compute elementwise but carry no tag), minus
  ``NOT_BROADCASTING`` (ops whose operands align by another rule than trailing dims).
- ``SHAPE_ONLY``: views, permutes, expands and factories: they move or create data by shape.
  ``RESHAPES`` are those among them that keep the row-major order of the elements and may merge
  or split dims (``view``, ``reshape``, ``flatten``, ``unflatten``).
- ``REDUCTIONS``: ``op(self, dim: int[], keepdim, ...)``, reducing over ``dim``.
- ``ALONG_DIM``: ops that act along one ``dim`` argument (softmax, cumsum, index_select, cat...);
  ``ALONG_DIM_SAME_SHAPE`` are those among them whose output has the input's shape and whose
  ``dim`` is their second argument, ``ALONG_DIM_MOVEMENT`` those that pick or cut elements
  along it without combining them, ``ALONG_DIM_OTHER`` the rest.
- ``TRAILING_NORMS``: ``op(input, normalized_shape, ...)`` normalizing the trailing dims.
- ``FRESH_RESULT``: ops whose single result never shares memory with an input (besides
  elementwise ops, which never alias).
- ``COMMUTATIVE``: binary elementwise ops with ``f(a, b) == f(b, a)`` bit for bit.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

aten = torch.ops.aten
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket

# Elementwise in effect, but without the pointwise tag in ATen. ``dropout`` and its kin are
# elementwise in eval mode (identity); their randomness is a separate question (see
# ``RANDOM_ONLY_WHEN_ASKED``). ``_to_copy``/``to``/``alias``/``contiguous`` convert or copy;
# ``copy(self, src)`` (functionalized ``self.copy_(src)``) is ``src`` broadcast to ``self``, and
# ``fill(self, value)`` (functionalized ``x[:, 0] = False``) is ``value`` broadcast to it.
# Overloads are listed where their family has others that are not elementwise
# (``where.default`` returns the indices of nonzeros) or that are tagged already: every tensor
# overload of a tagged family is here, tagged, or has its own rule
# (``tests/analysis/test_untagged_overloads.py``).
ELEMENTWISE_UNTAGGED = frozenset(
    {
        aten.hardswish, aten.log_sigmoid, aten.floor_divide, aten.__and__, aten.__or__,
        aten.__xor__, aten.dropout, aten.feature_dropout, aten.alpha_dropout, aten._to_copy,
        aten.to, aten.alias, aten.contiguous, aten.clone, aten.type_as, aten.copy, aten.fill,
        aten.where.Scalar, aten.where.ScalarSelf, aten.where.ScalarOther,
        aten.masked_fill.Tensor, aten.rsub.Tensor, aten.true_divide.Scalar,
    }
)

# ``prelu(x, w)`` aligns ``w`` with dim 1 of ``x`` (the channel), not with the trailing dim.
NOT_BROADCASTING = frozenset({aten.prelu, aten._prelu_kernel})

SHAPE_ONLY = frozenset(
    {
        aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten, aten.permute,
        aten.transpose, aten.unsqueeze, aten.expand, aten.expand_as, aten.alias, aten.clone,
        aten.contiguous, aten.detach, aten.t, aten.movedim, aten.select, aten.narrow,
        aten.lift_fresh_copy, aten._to_copy, aten.to, aten.type_as, aten.view_as,
        aten.reshape_as, aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like,
        aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full, aten.zeros, aten.ones,
        aten.empty, aten.full, aten.slice, aten.diagonal, aten.unfold,
    }
)

RESHAPES = frozenset(
    {
        aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten, aten.view_as,
        aten.reshape_as,
    }
)

REDUCTIONS = frozenset(
    {
        aten.sum, aten.mean, aten.amax, aten.amin, aten.prod, aten.var, aten.std, aten.any,
        aten.all, aten.logsumexp, aten.norm, aten.linalg_vector_norm, aten.var_mean,
        aten.std_mean, aten.count_nonzero, aten.nansum,
    }
)
# Reductions whose schema is exactly ``(self, dim, keepdim, ...)`` with a list ``dim``.
REDUCTIONS_DIM_KEEPDIM = frozenset({aten.sum, aten.mean, aten.amax, aten.amin, aten.nansum})

ALONG_DIM_SAME_SHAPE = frozenset(
    {
        aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, aten.cumsum,
        aten.cumprod, aten.logcumsumexp,
    }
)
ALONG_DIM_MOVEMENT = frozenset(
    {
        aten.index_select, aten.split, aten.split_with_sizes, aten.chunk, aten.unbind,
        aten.tensor_split,
    }
)
ALONG_DIM_OTHER = frozenset(
    {aten.cummax, aten.sort, aten.argsort, aten.topk, aten.kthvalue, aten.glu}
)
ALONG_DIM = ALONG_DIM_SAME_SHAPE | ALONG_DIM_MOVEMENT | ALONG_DIM_OTHER

TRAILING_NORMS = frozenset({aten.layer_norm, aten.rms_norm})

FRESH_RESULT = frozenset(
    {
        aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
        aten.linear.default, aten.matmul.default, aten.embedding.default,
        aten.index_select.default, aten.cat.default, aten.sum.dim_IntList, aten.mean.dim,
        aten._softmax.default, aten.softmax.int, aten.layer_norm.default,
        aten.batch_norm.default, aten.clone.default, aten.scaled_dot_product_attention.default,
    }
)

COMMUTATIVE = frozenset({aten.add.Tensor, aten.mul.Tensor})

# ``op(input, p, train)``: random when ``train``.
DROPOUTS = frozenset({aten.dropout, aten.feature_dropout, aten.alpha_dropout})


def dropout_in_training(node: Any) -> bool:
    """True for an FX node calling a dropout of :data:`DROPOUTS` with ``train`` set and ``p``
    not 0 (a dropout of 0 returns its input without drawing)."""
    if getattr(node, "op", None) != "call_function" or packet(node.target) not in DROPOUTS:
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", False)
    return bool(train) and p != 0

def draws_in_training(node: Any) -> bool:
    """True for a dropout in training mode (:func:`dropout_in_training`) and an attention with
    ``dropout_p`` set: the ops whose draws ``request_dropout="per_request"`` makes per request."""
    if dropout_in_training(node):
        return True
    if getattr(node, "op", None) != "call_function":
        return False
    if packet(node.target) is not aten.scaled_dot_product_attention:
        return False
    return bool(node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0))


# Tagged random because of an optional dropout; their rules check that it is off.
RANDOM_ONLY_WHEN_ASKED = DROPOUTS | frozenset(
    {aten.scaled_dot_product_attention, aten.gru, aten.lstm, aten.rnn_tanh, aten.rnn_relu}
)


def packet(target: Any) -> Any:
    """The overload packet of an ``OpOverload``; anything else as it is."""
    return getattr(target, "overloadpacket", target)


def is_random(target: Any) -> bool:
    """Draws random numbers (beyond an optional dropout that the op's rule checks)."""
    return isinstance(target, OpOverload) and (
        torch.Tag.nondeterministic_seeded in target.tags
        and target.overloadpacket not in RANDOM_ONLY_WHEN_ASKED
    )


def is_mutating(target: Any) -> bool:
    return isinstance(target, OpOverload) and target._schema.is_mutable


def is_elementwise(target: Any) -> bool:
    """Elementwise under ordinary broadcasting, deterministic, without mutation."""
    family = packet(target)
    if family in NOT_BROADCASTING:
        return False
    if family in ELEMENTWISE_UNTAGGED or target in ELEMENTWISE_UNTAGGED:
        return True
    if isinstance(target, OpOverload):
        return _tagged_elementwise(target)
    return isinstance(target, OpOverloadPacket) and _packet_elementwise(target)


def _tagged_elementwise(op: OpOverload) -> bool:
    return torch.Tag.pointwise in op.tags and not is_random(op) and not is_mutating(op)


@functools.cache
def _packet_elementwise(family: OpOverloadPacket) -> bool:
    return any(_tagged_elementwise(getattr(family, name)) for name in family.overloads())


def inplace_variant(op: Any) -> Optional[OpOverload]:
    """``op_`` with the same overload and arguments, writing into its first argument, for an
    elementwise ``op`` (``aten.relu.default`` -> ``aten.relu_.default``); None if ATen has none."""
    if not isinstance(op, OpOverload) or not is_elementwise(op):
        return None
    variant = _overload(op.overloadpacket.__name__ + "_", op._overloadname)
    if variant is None:
        return None
    args, variant_args = op._schema.arguments, variant._schema.arguments
    first = variant_args[0].alias_info if variant_args else None
    same = [a.name for a in args] == [a.name for a in variant_args]
    return variant if same and first is not None and first.is_write else None


@functools.cache
def _overload(name: str, overload: str) -> Optional[OpOverload]:
    try:
        family = getattr(aten, name)
    except (AttributeError, RuntimeError):
        return None
    if not isinstance(family, OpOverloadPacket) or overload not in family.overloads():
        return None
    return getattr(family, overload)
