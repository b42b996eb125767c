"""The one table from ATen op to truncation rule, by family."""

from __future__ import annotations

import operator

import torch

from .combining import (
    _arange_fill,
    _fill_value,
    _is_one,
    _is_zero,
    attending,
    checking,
    contracting,
    joining,
    linear,
    looking_up,
    making,
    reducing,
    scanning,
    sizing,
    softmaxing,
)
from .lattice import masks, register
from .positions import (
    expanding,
    normalizing,
    padding,
    permuting,
    picking,
    position_wise,
    selecting,
    splitting,
    view_like,
)

aten = torch.ops.aten

_POSITION_WISE = [
    aten.add, aten.sub, aten.mul, aten.div, aten.true_divide, aten.neg, aten.relu, aten.gelu,
    aten.silu, aten.sigmoid, aten.tanh, aten.exp, aten.log, aten.log1p, aten.expm1, aten.sqrt,
    aten.rsqrt, aten.pow, aten.abs, aten.sign, aten.clamp, aten.clamp_min, aten.clamp_max,
    aten.minimum, aten.maximum, aten.where, aten.masked_fill, aten.eq, aten.ne, aten.lt, aten.le,
    aten.gt, aten.ge, aten.logical_and, aten.logical_or, aten.logical_not, aten.logical_xor,
    aten.bitwise_and, aten.bitwise_or, aten.bitwise_not, aten.bitwise_xor, aten.prelu,
    aten.leaky_relu, aten.elu, aten.hardtanh, aten.hardsigmoid, aten.hardswish, aten.softplus,
    aten.erf, aten.rsub, aten.reciprocal, aten.square, aten._to_copy, aten.to, aten.type_as,
    aten.clone, aten.contiguous, aten.detach, aten.alias, aten.lift_fresh_copy, aten.dropout,
    aten.positive, aten.mish, aten.selu, aten.celu, aten.glu, aten.floor, aten.ceil, aten.round,
    aten.trunc, aten.fmod, aten.remainder, aten.floor_divide, aten.isnan, aten.isinf,
    aten.nan_to_num, aten.addcmul, aten.addcdiv, aten.lerp, aten.sin, aten.cos,
]  # fmt: skip
register(_POSITION_WISE, position_wise)
register([aten.layer_norm, aten.rms_norm], normalizing(("last",)))
register([aten.batch_norm], normalizing(("training",)))
register(
    [aten.view, aten.reshape, aten._unsafe_view, aten.unsqueeze, aten.squeeze, aten.flatten,
     aten.unflatten, aten.view_as, aten.reshape_as],
    view_like,
)  # fmt: skip
register([aten.permute, aten.transpose, aten.swapaxes, aten.t, aten.numpy_T], permuting)
register([aten.expand, aten.expand_as], expanding)
register([aten.select, aten.slice, aten.narrow], selecting)
register([aten.pad, aten.constant_pad_nd], padding)
register([aten.split, aten.split_with_sizes, aten.chunk, aten.unbind], splitting)
register([operator.getitem], picking)
register([aten.sum, aten.count_nonzero], reducing(_is_zero))
register([aten.any], reducing(_is_zero))
register([aten.all, aten.prod], reducing(_is_one))
register([aten.amax, aten.max, aten.logsumexp, aten.argmax], reducing(masks, needs_content=True))
register(
    [aten.mean, aten.var, aten.std, aten.norm, aten.amin, aten.min, aten.argmin, aten.var_mean,
     aten.std_mean, aten.median],
    reducing(lambda tail: False),
)  # fmt: skip
register([aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax], softmaxing)
register([aten.cumsum, aten.cumprod], scanning)
register([aten.matmul, aten.bmm, aten.mm], contracting)
register([aten.linear], linear)
register([aten.scaled_dot_product_attention], attending)
register([aten.embedding], looking_up)
register([aten.cat, aten.stack], joining)
register([aten.arange], making(_arange_fill))
register(
    [aten.zeros, aten.ones, aten.full, aten.empty, aten.zeros_like, aten.ones_like, aten.full_like,
     aten.empty_like, aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty],
    making(_fill_value),
)  # fmt: skip
register([aten.sym_size, aten.sym_numel, aten.sym_stride], sizing)
register(
    [operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg,
     operator.truediv, operator.pow, torch.sym_max, torch.sym_min, torch.sym_int,
     torch.sym_float, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
     operator.ge],
    sizing,
)  # fmt: skip
register(
    [aten._assert_scalar, aten.sym_constrain_range_for_size, aten.sym_constrain_range,
     aten._assert_async, aten._assert_tensor_metadata, torch._check],
    checking,
)  # fmt: skip
