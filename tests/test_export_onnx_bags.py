"""Embedding bags in ONNX programs as a gather and a scatter-add, or a reduction over the bag's
size for bags of 2-D ids (``export/onnx_bags.py``): the rewrite equals ``embedding_bag`` in every
mode (empty bags, padding ids, per-sample weights, offsets with and without the last one), and a
compiled model with bags exports to an ONNX graph with no ``Loop`` that ONNX Runtime runs as eager
does on ragged batches."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn
from torch.fx import _pytree as fx_pytree

import rocs_compiler as rocs
from rocs_compiler.export.onnx_bags import _gathered_bag

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


@pytest.mark.parametrize(
    "mode,padding_idx,weighted,last",
    [(m, p, w, last) for m, p, w, last in itertools.product((0, 1, 2), (None, 3, -1), (False, True),
                                                         (False, True))
     if not (w and m != 0)],  # per-sample weights are a sum bag's only
)  # fmt: skip
def test_the_gathered_bag_equals_embedding_bag(mode, padding_idx, weighted, last):
    torch.manual_seed(mode * 8 + weighted * 2 + last)
    weight = torch.randn(10, 4)
    ids = torch.tensor([3, 1, 3, 7, 0, 9, 3, 2, 5])
    offsets = torch.tensor([0, 0, 2, 2, 5, 9])  # empty bags first, inside and at the end
    if last:
        offsets = torch.cat([offsets, torch.tensor([9])])
    psw = torch.rand(ids.shape[0]) + 0.5 if weighted else None
    want = torch.ops.aten.embedding_bag.padding_idx(
        weight, ids, offsets, False, mode, False, psw, last, padding_idx
    )[0]
    got = _gathered_bag(weight, ids, offsets, False, mode, False, psw, last, padding_idx)[0]
    torch.testing.assert_close(got, want)


class _Bags(nn.Module):
    """A ranker whose user ids and item tags are pooled by embedding bags (sum, mean with a
    padding id, max) feeding an MLP over both sides."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.user = nn.EmbeddingBag(50, 8, mode="sum")
        self.history = nn.EmbeddingBag(50, 8, mode="mean", padding_idx=0)
        self.tags = nn.EmbeddingBag(40, 8, mode="max")
        self.mlp = nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, user_ids, history, tags):
        u = self.user(user_ids) + self.history(history)
        return self.mlp(torch.cat([u, self.history(history), self.tags(tags)], 1))


def _batch(counts, seed):
    g = torch.Generator().manual_seed(seed)
    requests = len(counts)
    index = torch.repeat_interleave(torch.arange(requests), torch.tensor(counts))
    history = torch.randint(1, 50, (requests, 6), generator=g)
    history[0, 3:] = 0  # padded
    return {
        "user_ids": torch.randint(0, 50, (requests, 2), generator=g),
        "history": history,
        "tags": torch.randint(0, 40, (index.shape[0], 3), generator=g),
    }, index


def test_a_model_with_bags_runs_in_onnx_runtime_without_a_loop(tmp_path):
    model = _Bags().eval()
    example, index = _batch([3, 1, 5], seed=0)
    replicated = {k: (v[index] if k != "tags" else v) for k, v in example.items()}
    cm = rocs.compile(model, ["user_ids", "history"], example_kwargs=replicated)
    program = rocs.export(cm, portable=True)
    bags = [n for n in program.graph.nodes if "embedding_bag" in str(n.target)]
    assert bags, "the portable program pools by embedding_bag"
    path = rocs.export_onnx(program, tmp_path / "bags.onnx")
    ops = {node.op_type for node in onnx.load(path).graph.node}
    # Bags of 2-D ids (one size each) reduce over that size: no scatter either.
    assert "Loop" not in ops and "ScatterElements" not in ops, sorted(ops)
    assert {"ReduceSum", "ReduceMax"} <= ops, sorted(ops)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(path, options)
    for counts, seed in (([3, 1, 17], 1), ([1], 2), ([2, 2, 2, 2], 3)):
        kwargs, index = _batch(counts, seed)
        with torch.no_grad():
            want = model(**{k: (v[index] if k != "tags" else v) for k, v in kwargs.items()})
        assert want.numel() == 1 or want.std() > 1e-2, "outputs vary far beyond the tolerance"
        flat = fx_pytree.tree_flatten_spec(
            ((), {**kwargs, "candidate_to_request": index}), program.call_spec.in_spec
        )
        feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), flat)}
        (got,) = session.run(None, feeds)
        torch.testing.assert_close(torch.from_numpy(np.asarray(got)), want, rtol=1e-4, atol=1e-5)


class _OneBag(nn.Module):
    """One bag over 2-D ids of one size (``F.embedding_bag``'s fixed-size form) beside a linear."""

    def __init__(self, mode: str, padding_idx, weighted: bool):
        super().__init__()
        torch.manual_seed(1)
        self.bag = nn.EmbeddingBag(30, 6, mode=mode, padding_idx=padding_idx)
        self.weighted = weighted
        self.out = nn.Linear(6 + 2, 1)

    def forward(self, ids, weights, dense):
        pooled = self.bag(ids, per_sample_weights=weights if self.weighted else None)
        return self.out(torch.cat([pooled, dense], 1))


@pytest.mark.parametrize(
    "mode,padding_idx,weighted",
    [("sum", None, False), ("sum", 0, True), ("mean", None, False), ("mean", 0, False),
     ("max", None, False), ("max", -1, False)],
)  # fmt: skip
def test_a_bag_of_2d_ids_reduces_over_its_size_in_onnx_runtime(
    tmp_path, mode, padding_idx, weighted
):
    """Padding ids left out of a sum, a mean's count and a max, a bag of padding only 0, and
    per-sample weights, as ``embedding_bag`` computes them, through ONNX Runtime."""
    model = _OneBag(mode, padding_idx, weighted).eval()
    g = torch.Generator().manual_seed(5)

    def call(rows):
        ids = torch.randint(0, 30, (rows, 4), generator=g)
        ids[0] = 0 if padding_idx == 0 else 29  # every id of the first bag its padding id
        ids[1, 2:] = ids[0, 0]
        return {"ids": ids, "weights": torch.rand(rows, 4, generator=g) + 0.5,
                "dense": torch.randn(rows, 2, generator=g)}  # fmt: skip

    example = call(5)
    cm = rocs.compile(model, [], example_kwargs=example)
    program = rocs.export(cm, portable=True)
    path = rocs.export_onnx(program, tmp_path / "bag.onnx")
    ops = {node.op_type for node in onnx.load(path).graph.node}
    assert "Loop" not in ops and "ScatterElements" not in ops, sorted(ops)
    assert any("embedding_bag" in str(n.target) for n in program.graph.nodes)  # left as it was
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(path, options)
    for rows in (3, 9):
        kwargs = call(rows)
        index = torch.arange(rows)
        with torch.no_grad():
            want = model(**kwargs)
        flat = fx_pytree.tree_flatten_spec(
            ((), {**kwargs, "candidate_to_request": index}), program.call_spec.in_spec
        )
        feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), flat)}
        (got,) = session.run(None, feeds)
        torch.testing.assert_close(torch.from_numpy(np.asarray(got)), want, rtol=1e-5, atol=1e-5)
