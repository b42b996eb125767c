"""Row-wise helper ops that normalization rewrites produce (not IKBO ops).

``rocs::embedding_bag_rows(weight, indices [B, L], mode, padding_idx)`` pools each row of a
fixed-length index matrix into one bag. It calls ``aten.embedding_bag`` exactly as
``nn.EmbeddingBag`` does for 2-D input, so results are bit-identical; unlike the flattened
spelling it is visibly row-wise: its role rule (registered below, with the op) is that of a
table lookup, and its lane pools each row's id taints.

Backward (torch, any device): for ``sum`` and ``mean`` the table's gradient is
``zeros_like(weight).index_add_(0, indices, g[b] * w[b, l])`` over the entries, with
``w = 1`` (sum) or ``1 / count[b]`` (mean, ``count`` the row's non-padding entries) and
``w = 0`` at ``padding_idx``, which is excluded from the bag; nothing of the forward is
recomputed. ``max`` needs the forward's argmax: its backward differentiates the op again.
"""

from __future__ import annotations

import torch

from rocs_compiler.analysis.role_rules import Lane, register, table_lookup_rule
from rocs_compiler.kernels.rocs_op import RocsOp, define, vjp

MODE_SUM, MODE_MEAN, MODE_MAX = 0, 1, 2


def _check(weight, indices, mode, padding_idx):
    if indices.dim() != 2:
        raise ValueError(
            f"rocs::embedding_bag_rows: indices must be [B, L], got {list(indices.shape)}"
        )
    return None, None


def _cpu(weight, indices, mode, padding_idx):
    rows, width = indices.shape
    offsets = torch.arange(0, rows * width, width, dtype=indices.dtype, device=indices.device)
    return torch.ops.aten.embedding_bag.padding_idx(
        weight, indices.reshape(-1), offsets, False, mode, False, None, False, padding_idx
    )[0]


def bag_gradient_rows(grad, indices, mode, padding_idx, num_rows):
    """(table row ids, gradient rows) of a sum or mean bag: the module docstring's formula
    before its ``index_add`` (``num_rows``: the table's, for a negative ``padding_idx``)."""
    rows, width = indices.shape
    entries = grad.unsqueeze(1).expand(rows, width, grad.shape[1])
    if padding_idx is not None:
        keep = indices != (padding_idx if padding_idx >= 0 else padding_idx + num_rows)
        share = keep.to(grad.dtype)
        if mode == MODE_MEAN:
            share = share / keep.sum(1, keepdim=True).clamp_min(1)
        entries = entries * share.unsqueeze(2)
    elif mode == MODE_MEAN and width > 0:
        entries = entries / width
    return indices.reshape(-1), entries.reshape(rows * width, grad.shape[1])


def _backward(needs, grad, weight, indices, mode, padding_idx):
    """The module docstring's formula; ``(d weight, None, None, None)``."""
    if not needs[0]:
        return None, None, None, None
    if mode == MODE_MAX:
        return vjp(_cpu, grad, (weight, indices, mode, padding_idx), needs)
    ids, source = bag_gradient_rows(grad, indices, mode, padding_idx, weight.shape[0])
    return torch.zeros_like(weight).index_add_(0, ids, source), None, None, None


def _fake(weight, indices, mode, padding_idx):
    return weight.new_empty((indices.shape[0], weight.shape[1]))


def _reference(weight, indices, mode, padding_idx):
    """The spelling ``nn.EmbeddingBag`` uses for 2-D input."""
    return torch.nn.functional.embedding_bag(
        indices, weight, mode=("sum", "mean", "max")[mode], padding_idx=padding_idx
    )


EMBEDDING_BAG_ROWS = define(
    RocsOp(
        name="embedding_bag_rows",
        check=_check,
        fake=_fake,
        cpu=_cpu,
        reference=_reference,
        backward=_backward,
    )
)
register(torch.ops.rocs.embedding_bag_rows, lane=Lane.LOOKUP)(table_lookup_rule)
