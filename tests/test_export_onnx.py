"""Portable programs in ONNX Runtime (``rocs.export_onnx``): dynamic R and N, scores equal to the
original model's (rtol 1e-4) for zoo models and a DeepCTR-Torch model, misused calls refused by
ONNX Runtime at the program's check node, and a program with rocs:: ops refused with their names.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

import rocs_compiler as rocs
from models_zoo import get_entry
from rocs_compiler.export import input_signature
from rocs_compiler.export.onnx import CHECK_NODE_NAME

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

# ragged batches: R > 1 with 1, 3 and 17 candidates, R = 1, and R = N (one candidate each)
BATCHES = [([3, 1, 17], True), ([1], False), ([5], False), ([1, 1, 1], True)]


def _session(program, path) -> "ort.InferenceSession":
    """An ONNX Runtime session of ``program``, whose ONNX graph holds no ``Loop`` (an op
    translated as a loop over its rows, as the exporter does embedding bags, runs node by node)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    path = rocs.export_onnx(program, path)
    ops = {node.op_type for node in onnx.load(path).graph.node}
    assert "Loop" not in ops, sorted(ops)
    return ort.InferenceSession(path, options)


def _run(session, program, kwargs: dict) -> list[np.ndarray]:
    flat = fx_pytree.tree_flatten_spec(((), kwargs), program.call_spec.in_spec)
    feeds = {spec.name: t.numpy() for spec, t in zip(session.get_inputs(), flat)}
    return session.run(None, feeds)


def _assert_exact(got: list[np.ndarray], expected, what: str) -> None:
    want = pytree.tree_leaves(expected)
    assert len(got) == len(want), what
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.from_numpy(a), b, rtol=1e-4, atol=1e-5, msg=what)


def _zoo_session(name, tmp_path):
    entry = get_entry(name)
    model = entry.build()
    example = entry.make_batch([3, 1, 5]).replicated()
    cm = rocs.compile(model, list(entry.request_inputs), example_kwargs=example)
    program = rocs.export(cm, portable=True)
    return entry, model, cm, program, _session(program, tmp_path / f"{name}.onnx")


def _check_zoo_model(name, tmp_path):
    entry, model, cm, program, session = _zoo_session(name, tmp_path)
    dynamic = {d for i in session.get_inputs() for d in i.shape if isinstance(d, str)}
    assert len(dynamic) >= 2, f"R and N are dynamic ONNX dims: {dynamic}"
    for i, (counts, shuffle) in enumerate(BATCHES):
        batch = entry.make_batch(counts, seed=50 + i, shuffle=shuffle)
        kwargs = {**batch.kwargs, "candidate_to_request": batch.candidate_to_request}
        with torch.no_grad():
            expected = model(**batch.replicated())
        _assert_exact(_run(session, program, kwargs), expected, f"{name} {counts}")
    return entry, program, session


@pytest.mark.parametrize("name", ["dlrm", "target_attention"])
def test_zoo_models_run_in_onnx_runtime(name, tmp_path):
    _check_zoo_model(name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["dcnv2", "finalmlp", "wukong", "din", "bst", "two_tower", "mmoe", "hstu"]
)
def test_every_other_zoo_model_runs_in_onnx_runtime(name, tmp_path):
    _check_zoo_model(name, tmp_path)


def test_onnx_runtime_refuses_a_misused_call(tmp_path):
    entry, model, cm, program, session = _zoo_session("dcnv2", tmp_path)
    batch = entry.make_batch([2, 3], seed=1)
    index = batch.candidate_to_request
    _assert_exact(_run(session, program, {**batch.kwargs, "candidate_to_request": index}),
                  model(**batch.replicated()), "dcnv2")  # fmt: skip
    calls = {
        "replicated request rows": {**batch.replicated(), "candidate_to_request": index},
        "index past R": {**batch.kwargs, "candidate_to_request": index + 1},
        "negative index": {**batch.kwargs, "candidate_to_request": index - 1},
    }
    for what, kwargs in calls.items():
        with pytest.raises(Exception, match="rocs input check failed") as refused:
            _run(session, program, kwargs)
        assert CHECK_NODE_NAME in str(refused.value), what


def test_a_program_with_rocs_ops_is_refused_naming_them(tmp_path):
    entry = get_entry("dlrm")
    cm = rocs.compile(
        entry.build(), list(entry.request_inputs), example_kwargs=entry.make_batch([2]).replicated()
    )
    with pytest.raises(rocs.CompileError, match=r"rocs\.broadcast_\w+.*portable=True"):
        rocs.export_onnx(rocs.export(cm), tmp_path / "fused.onnx")


def test_a_deepctr_model_runs_in_onnx_runtime(tmp_path):
    pytest.importorskip("deepctr_torch")
    from models_zoo.deepctr_models import build, draw, request_ranges

    model, user, _ = build("din")
    example, _ = draw(model, user, [2, 1, 3], seed=0)
    cm = rocs.compile(model, request_ranges(model, user), example_kwargs={"X": example})
    program = rocs.export(cm, portable=True)
    session = _session(program, tmp_path / "deepctr_din.onnx")
    for seed, counts in enumerate([[3, 1, 17], [1], [4, 2]]):
        x, index = draw(model, user, counts, seed=seed + 1)
        starts = torch.tensor([int((index == r).nonzero()[0]) for r in range(len(counts))])
        pieces = {}
        for leaf in input_signature(program):
            if leaf.startswith("X."):  # a column range "X.first:last", R rows if request-side
                first, last = (int(v) for v in leaf.removeprefix("X.").split(":"))
                request = leaf in cm.contract.request_inputs
                pieces[leaf.removeprefix("X.")] = x[starts if request else slice(None), first:last]
        with torch.no_grad():
            expected = model(x)
        kwargs = {"X": pieces, "candidate_to_request": index}
        _assert_exact(_run(session, program, kwargs), expected, f"deepctr din {counts}")
    # the merged column pieces by name: user_id and gender, item_id and cate_id, the history
    inputs = {i.name: i.shape for i in session.get_inputs()}
    assert inputs == {"X.0:2": ["R", 2], "X.2:4": ["N", 2], "X.4:13": ["R", 9],
                      "candidate_to_request": ["N"]}  # fmt: skip



@pytest.fixture(scope="module")
def target_attention(tmp_path_factory):
    return _zoo_session("target_attention", tmp_path_factory.mktemp("onnx"))


def test_a_request_whose_history_is_all_padding_scores_as_in_eager(target_attention):
    """Eager's attention gives zeros to a query that sees no key; ONNX's translation of a masked
    attention does not (uniform weights, or NaN), so the program spells it out."""
    entry, model, _, program, session = target_attention
    for seed, counts in enumerate([[3, 1, 2], [1], [2, 5]]):
        batch = entry.make_batch(counts, seed=seed)
        batch.kwargs["hist_item_ids"][0] = 0  # the first request has no history at all
        kwargs = {**batch.kwargs, "candidate_to_request": batch.candidate_to_request}
        with torch.no_grad():
            expected = model(**batch.replicated())
        _assert_exact(_run(session, program, kwargs), expected, f"all padding {counts}")


class _FloatMaskAttention(torch.nn.Module):
    """The candidate attends over the request's history under a float key mask of -inf."""

    def __init__(self):
        super().__init__()
        self.key = torch.nn.Linear(8, 8)
        self.query = torch.nn.Linear(4, 8)

    def forward(self, history, lengths, item):
        keys = self.key(history).view(history.shape[0], 1, history.shape[1], 8)
        query = self.query(item).view(-1, 1, 1, 8)
        padding = torch.arange(history.shape[1]) >= lengths[:, None]
        mask = torch.zeros(padding.shape).masked_fill(padding, float("-inf"))[:, None, None, :]
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, keys, attn_mask=mask)
        return out.flatten(1).sum(-1) + item.sum(-1)


def test_a_float_mask_of_minus_infinity_scores_as_in_eager(tmp_path):
    torch.manual_seed(0)
    model = _FloatMaskAttention().eval()
    index = torch.tensor([0, 0, 1, 2, 2])
    history, lengths = torch.randn(3, 6, 8) * 3, torch.tensor([4, 0, 6])  # request 1: no key
    item = torch.randn(5, 4) * 3
    cm = rocs.compile(
        model, ["history", "lengths"],
        example_kwargs={"history": history[index], "lengths": lengths[index], "item": item},
    )  # fmt: skip
    program = rocs.export(cm, portable=True)
    session = _session(program, tmp_path / "float_mask.onnx")
    kwargs = {"history": history, "lengths": lengths, "item": item, "candidate_to_request": index}
    with torch.no_grad():
        expected = model(history[index], lengths[index], item)
    assert expected.std() > 1.0  # rows differ far beyond the tolerance
    _assert_exact(_run(session, program, kwargs), expected, "float mask")


def test_inputs_and_sizes_have_names(target_attention):
    """ONNX inputs by their leaf names, dynamic dims R (request rows), N (candidate rows) and
    L_<input> (a length); ``input_signature`` names the sizes the same way."""
    from rocs_compiler.export.size_names import size_names

    *_, program, session = target_attention
    signature = input_signature(program)
    assert [i.name for i in session.get_inputs()] == list(signature)
    assert [i.shape for i in session.get_inputs()] == [s["shape"] for s in signature.values()]
    assert signature["hist_item_ids"]["shape"] == ["R", 64]
    assert signature["item_id"]["shape"] == signature["candidate_to_request"]["shape"] == ["N"]
    padded = {"history": {"shape": ["s3", "s7"]}, "item": {"shape": ["s5", 4]},
              "candidate_to_request": {"shape": ["s5"]}}  # fmt: skip
    assert size_names(padded) == {"s5": "N", "s3": "R", "s7": "L_history"}


def test_a_portable_attention_runs_per_request_in_onnx_runtime(target_attention, tmp_path):
    """The portable attention (``kernels/attention_portable.py``: a ``torch.cond`` between a batch
    where no request has more than ``ceil(N / R)`` candidates and one where a request spills, an
    ONNX ``If``) on ragged batches: a request without candidates, one that spills, equal counts,
    one candidate each; the target-attention zoo model and a model whose output is the attention
    itself, two queries per candidate, a request whose candidates see no key."""
    from test_export_portable_attention import BATCHES, _Batch, candidate_attention

    entry, model, _, program, session = target_attention
    attention, cm = candidate_attention()
    attention_program = rocs.export(cm, portable=True)
    path = tmp_path / "candidate_attention.onnx"
    attention_session = _session(attention_program, path)
    assert "If" in {node.op_type for node in onnx.load(path).graph.node}
    for i, (counts, shuffle) in enumerate(BATCHES):
        cases = [
            (entry.make_batch(counts, seed=90 + i, shuffle=shuffle), model, program, session),
            (_Batch(counts, 95 + i, shuffle), attention, attention_program, attention_session),
        ]
        for batch, original, exported, runtime in cases:
            kwargs = {**batch.kwargs, "candidate_to_request": batch.candidate_to_request}
            with torch.no_grad():
                expected = original(**batch.replicated())
            assert (expected - expected[0]).abs().max() > 1e-3  # rows differ beyond the tolerance
            _assert_exact(_run(runtime, exported, kwargs), expected, f"attention {counts}")
