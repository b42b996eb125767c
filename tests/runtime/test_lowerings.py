"""The inference program's faster equivalents of ATen ops (``runtime/program/lowerings.py``) compute
exactly what the op does, are chosen only where the node's shapes allow them, and never in a
training program."""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from rocs_compiler.runtime.program.direct import DirectProgram
from rocs_compiler.runtime.program.lowerings import embedding_one_column

aten = torch.ops.aten
g = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("shape", [(7,), (5, 3), (2, 4, 3), (0, 6), (1,), (300, 6), (2048,)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("padding_idx", [-1, 2])
def test_one_column_embedding_is_the_op_bit_for_bit(shape, dtype, padding_idx):
    weight = torch.randn(9, 1, generator=g)
    indices = torch.randint(0, 9, shape, generator=g, dtype=dtype)
    expected = aten.embedding.default(weight, indices, padding_idx)
    got = embedding_one_column(weight, indices, padding_idx)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert got.is_contiguous()
    assert torch.equal(got, expected)


def test_one_column_embedding_of_a_strided_table_and_strided_indices():
    table = torch.randn(9, 3, generator=g)[:, 1:2]  # [9, 1] with row stride 3
    indices = torch.randint(0, 9, (600, 4), generator=g).t()  # not contiguous
    assert torch.equal(embedding_one_column(table, indices), aten.embedding.default(table, indices))


@pytest.mark.parametrize("bad", [9, -1])
def test_one_column_embedding_refuses_what_the_op_refuses(bad):
    weight = torch.randn(9, 1, generator=g)
    indices = torch.zeros(2, 1024, dtype=torch.int64)  # the gather's size
    indices[1, 7] = bad
    with pytest.raises(IndexError):
        aten.embedding.default(weight, indices)
    with pytest.raises(IndexError):
        embedding_one_column(weight, indices)


def _wide_and_deep() -> fx.GraphModule:
    """``wide(ids).sum(1) + deep(ids).sum(1)`` over a ``[20, 1]`` and a ``[20, 4]`` table, as
    capture leaves it: ATen nodes whose placeholders carry their traced values."""
    graph = fx.Graph()
    wide, deep, ids = (graph.placeholder(name) for name in ("wide", "deep", "ids"))
    looked_up = [graph.call_function(aten.embedding.default, (w, ids)) for w in (wide, deep)]
    pooled = [graph.call_function(aten.sum.dim_IntList, (rows, [1])) for rows in looked_up]
    graph.output(graph.call_function(aten.add.Tensor, tuple(pooled)))
    return fx.GraphModule({}, graph)


def _lowered(program: DirectProgram) -> int:
    return sum(v is embedding_one_column for v in program._globals.values())


class _Ops(TorchDispatchMode):
    """The ATen ops a call runs."""

    def __enter__(self):
        self.ran = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ran.append(func)
        return func(*args, **(kwargs or {}))


def test_the_inference_program_gathers_the_one_column_table_only():
    wide, deep = torch.randn(20, 1, generator=g), torch.randn(20, 4, generator=g)
    gm = _wide_and_deep()
    for node, value in zip(gm.graph.nodes, (wide, deep, torch.zeros(5, 3, dtype=torch.int64))):
        node.meta["val"] = value
    program = DirectProgram(gm)
    assert _lowered(program) == 1  # the [20, 1] table; the [20, 4] one keeps the op
    for rows, embeddings in ((5, 2), (400, 1)):  # 15 ids: the op itself; 1,200: the gather
        ids = torch.randint(0, 20, (rows, 3), generator=g)
        with _Ops() as ops:
            got = program(wide, deep, ids)
        assert ops.ran.count(aten.embedding.default) == embeddings
        assert torch.equal(got, wide[ids].sum(1) + deep[ids].sum(1))
    assert _lowered(DirectProgram(gm, differentiable=True)) == 0


def test_a_node_without_its_traced_value_keeps_the_op():
    gm = _wide_and_deep()
    wide, deep = torch.randn(20, 1, generator=g), torch.randn(20, 4, generator=g)
    ids = torch.randint(0, 20, (5, 3), generator=g)
    program = DirectProgram(gm)
    assert _lowered(program) == 0
    assert torch.equal(program(wide, deep, ids), wide[ids].sum(1) + deep[ids].sum(1))
