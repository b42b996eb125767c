"""Row-wise helper ops that normalization rewrites produce (not IKBO ops).

``rocs::embedding_bag_rows(weight, indices [B, L], mode, padding_idx)`` pools each row of a
fixed-length index matrix into one bag. It calls ``aten.embedding_bag`` exactly as
``nn.EmbeddingBag`` does for 2-D input, so results are bit-identical; unlike the flattened
spelling it is visibly row-wise: its role rule (registered below, with the op) is that of a
table lookup, and its lane pools each row's id taints.
"""

from __future__ import annotations

import torch

from rocs_compiler.analysis.role_rules import Lane, register, table_lookup_rule
from rocs_compiler.kernels.rocs_op import RocsOp, define


def _check(weight, indices, mode, padding_idx):
    if indices.dim() != 2:
        raise ValueError(f"rocs::embedding_bag_rows: indices must be [B, L], got {list(indices.shape)}")
    return None, None


def _cpu(weight, indices, mode, padding_idx):
    rows, width = indices.shape
    offsets = torch.arange(0, rows * width, width, dtype=indices.dtype, device=indices.device)
    return torch.ops.aten.embedding_bag.padding_idx(
        weight, indices.reshape(-1), offsets, False, mode, False, None, False, padding_idx
    )[0]


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
        schema="(Tensor weight, Tensor indices, int mode, int? padding_idx) -> Tensor",
        check=_check,
        fake=_fake,
        cpu=_cpu,
        reference=_reference,
    )
)
register(torch.ops.rocs.embedding_bag_rows, lane=Lane.LOOKUP)(table_lookup_rule)
