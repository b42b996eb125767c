"""Role rules of the ops that reduce or scan along dims: sums, means, norms over dims, max and
min, arg-reductions, softmax, cumulative ops and sorts.

Each is row-wise unless one of the dims it acts along is the batch dim (or it acts on the
flattened tensor, which includes the batch dim).
"""

from __future__ import annotations

import torch

from . import op_groups
from .rule_families import along_dim_rule, reduction_rule
from .rule_registry import Lane, register

aten = torch.ops.aten

_BY_DIM = op_groups.REDUCTIONS_DIM_KEEPDIM | {aten.any, aten.all}  # (self, dim, keepdim, ...)
register(*_BY_DIM, lane=Lane.REDUCTION)(reduction_rule("dim"))
register(*(op_groups.REDUCTIONS - _BY_DIM))(reduction_rule("dim"))
register(aten.max.dim, aten.min.dim, aten.argmax, aten.argmin, aten.median.dim)(
    reduction_rule("dim")
)
register(aten.max.default, aten.min.default)(reduction_rule("dim"))  # over every dim
register(*op_groups.ALONG_DIM_SAME_SHAPE, lane=Lane.ALONG_DIM)(along_dim_rule("dim", default=-1))
register(*op_groups.ALONG_DIM_MOVEMENT, lane=Lane.MOVEMENT)(along_dim_rule("dim", default=-1))
register(*op_groups.ALONG_DIM_OTHER)(along_dim_rule("dim", default=-1))
