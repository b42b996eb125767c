"""The batch-axis lattice: where a request value holds its requests, through reshapes and merges.

Shapes are fake tensors with a symbolic batch size, as capture leaves them; every derived axis is
checked against the identity it stands for: gathering rows along the input's axis, then
reshaping, equals reshaping, then gathering along the output's axis.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from rocs_compiler.analysis.batch_axis import BatchAxis, gather_rows, output_axis, reshape_axis

INDEX = torch.tensor([2, 0, 0, 1])


def _symbolic_env():
    """(fake mode, batch symbol, batch size as a SymInt) for shapes with a symbolic batch."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    size = env.create_symintnode(env.create_symbol(3, source=ConstantSource("batch")), hint=3)
    return mode, size.node.expr, size


@pytest.mark.parametrize(
    "shape, axis, target, expected",
    [
        # [B, F, D] -> [B*F, D]: the batch is the outer factor.
        ((3, 4, 5), BatchAxis(0), lambda b: (b * 4, 5), BatchAxis(0, 1, 4)),
        # [L, B, E] -> [L*B, E]: the batch is the inner factor (attention's output projection).
        ((4, 3, 5), BatchAxis(1), lambda b: (4 * b, 5), BatchAxis(0, 4, 1)),
        # [L, B*H, d] -> [L, B, H, d]: split back into a plain axis.
        ((4, 6, 5), BatchAxis(1, 1, 2), lambda b: (4, b, 2, 5), BatchAxis(1)),
        # [B*H, L, d] -> [B, H, L, d].
        ((6, 4, 5), BatchAxis(0, 1, 2), lambda b: (b, 2, 4, 5), BatchAxis(0)),
        # [B, D] -> [B, 2, D/2] keeps the plain axis.
        ((3, 6), BatchAxis(0), lambda b: (b, 2, 3), BatchAxis(0)),
    ],
)
def test_reshape_axis_commutes_with_gathering(shape, axis, target, expected):
    rows = 3
    real = torch.randn(shape)
    out_shape = target(rows)
    got = _axis_of_reshape(shape, axis, out_shape, rows)
    assert got == expected
    # The identity: gather(reshape(x)) == reshape(gather(x)) with R -> len(INDEX) rows.
    gathered_first = gather_rows(real, axis, INDEX)
    n = INDEX.numel()
    reshaped_after = gathered_first.reshape(target(n))
    assert torch.equal(gather_rows(real.reshape(out_shape), got, INDEX), reshaped_after)


def test_a_reshape_that_cuts_through_the_batch_is_refused():
    """[D, B] -> [D*B] -> [B, D]: each new row takes one feature of several requests."""
    flat = _axis_of_reshape((4, 3), BatchAxis(1), (12,), 3)
    assert flat == BatchAxis(0, 4, 1)
    assert isinstance(_axis_of_reshape((12,), flat, (3, 4), 3), str)


def test_operands_merged_in_different_orders_do_not_meet():
    """[B*H] (batch outer) and [H*B] (batch inner) have one size but different rows."""
    mode, symbol, size = _symbolic_env()
    with mode:
        out = torch.empty(4 * size)
    both = [BatchAxis(0, 1, 4), BatchAxis(0, 4, 1)]
    reason = output_axis(out, both, symbol, sized_from_batch=False)
    assert isinstance(reason, str) and "different orders" in reason
    one = output_axis(out, both[:1], symbol, sized_from_batch=False)
    assert one == BatchAxis(0, 1, 4)


def test_a_value_sized_by_the_batch_is_plain_only_when_its_order_is_known():
    mode, symbol, size = _symbolic_env()
    with mode:
        state, merged = torch.empty(2, size, 8), torch.empty(2 * size, 8)
    assert output_axis(state, [], symbol, sized_from_batch=True) == BatchAxis(1)
    assert isinstance(output_axis(merged, [], symbol, sized_from_batch=True), str)


def _axis_of_reshape(shape, axis: BatchAxis, out_shape, rows: int):
    """reshape_axis on fake tensors whose batch factor is symbolic (``rows`` in the example)."""
    mode, symbol, size = _symbolic_env()
    merged = axis.outer * axis.inner
    source_dims = [size * merged if i == axis.dim else d for i, d in enumerate(shape)]
    with mode:
        source = torch.empty(source_dims)
        out = torch.empty(_with_batch(out_shape, rows, size))
    return reshape_axis(source, axis, out, symbol)


def _with_batch(out_shape, rows, size):
    """Replace the first dim that is a multiple of ``rows`` by that multiple of the batch."""
    dims = list(out_shape)
    for i, d in enumerate(dims):
        if d % rows == 0:
            dims[i] = size * (d // rows)
            return dims
    raise AssertionError(out_shape)
