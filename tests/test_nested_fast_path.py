"""A compiled model gives eager's answer where ``nn.TransformerEncoder`` takes its nested path.

In eager, an encoder in inference with a ``src_key_padding_mask`` whose every row is left
aligned runs on the valid positions only and returns zeros at the padded ones (before its final
norm); ``torch.export`` takes the padded path, where they hold the layers' values. The model
here averages all positions, padding included, so the two differ by far more than the
tolerance (checked). The oracle is always the original model called eagerly on the replicated
batch under ``torch.no_grad()`` (or in the call's own mode), never a formula of the op.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

import rocs_compiler as rocs
from rocs_compiler.ir.graph_meta import PLACEMENT
from rocs_compiler.ir.roles import Role
from rocs_compiler.kernels.nested_padding import fast_path_state

D, L, F_HIST, F_CAND = 16, 6, 8, 4
TOL = {"rtol": 1e-4, "atol": 1e-5}
INDEX = torch.tensor([0, 0, 1, 2, 2, 2, 1, 3, 3, 0])  # 4 requests: 3, 2, 3 and 2 candidates


class HistoryRanker(nn.Module):
    """A history encoder whose output is averaged over every position (padding included),
    concatenated with the candidate's features, and scored by an MLP."""

    def __init__(self, norm: bool = False, mask_check: bool = True):
        super().__init__()
        self.embed = nn.Linear(F_HIST, D)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's nested-tensor prototype warning
            layer = nn.TransformerEncoderLayer(D, 4, 2 * D, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(
                layer, 2, norm=nn.LayerNorm(D) if norm else None, mask_check=mask_check
            )
        self.mlp = nn.Sequential(nn.Linear(D + F_CAND, D), nn.ReLU(), nn.Linear(D, 1))

    def forward(self, hist, padding, cand):
        states = self.encoder(self.embed(hist), src_key_padding_mask=padding)
        return self.mlp(torch.cat([states.mean(1), cand], -1))


def _padding(lengths: list[int]) -> torch.Tensor:
    """Right padding: row r is valid on its first ``lengths[r]`` positions."""
    return torch.arange(L) >= torch.tensor(lengths).unsqueeze(1)


def _requests(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(lengths), L, F_HIST, generator=g), _padding(lengths)


def _candidates(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, F_CAND, generator=torch.Generator().manual_seed(seed))


def _compiled(norm: bool = False, **kw):
    torch.manual_seed(0)
    model = HistoryRanker(norm=norm, **kw).eval()
    hist, padding = _requests([6, 3, 1])
    example = {"hist": hist[[0, 0, 1, 2]], "padding": padding[[0, 0, 1, 2]], "cand": _candidates(4)}
    return model, rocs.compile(model, ["hist", "padding"], example_kwargs=example)


def _eager(model, hist, padding, cand, index):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(hist[index], padding[index], cand)


def _padded_path(model, hist, padding, cand, index):
    """The original model with the nested path off: what the captured graph computes alone."""
    with _fast_path(False):
        return _eager(model, hist, padding, cand, index)


@contextlib.contextmanager
def _fast_path(enabled: bool):
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def _both_layouts(cm, hist, padding, cand, index) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {
            "shared": cm(hist=hist, padding=padding, cand=cand, candidate_to_request=index),
            "drop-in": cm(hist=hist[index], padding=padding[index], cand=cand),
        }


def _assert_meaningful(want, other):
    """The outputs vary across rows, and ``other`` (the answer the test rules out) is far from
    ``want``: the comparison can fail."""
    assert want.std() > 1e3 * TOL["atol"], "outputs barely vary"
    assert (want - other).abs().max() > 1e3 * TOL["atol"], "the two paths agree"


@pytest.mark.parametrize("norm", [False, True], ids=["no-norm", "final-norm"])
def test_left_aligned_histories_get_eagers_zeros_in_both_layouts(norm):
    model, cm = _compiled(norm)
    hist, padding = _requests([6, 3, 1, 4], seed=2)
    cand = _candidates(INDEX.shape[0])
    want = _eager(model, hist, padding, cand, INDEX)
    _assert_meaningful(want, _padded_path(model, hist, padding, cand, INDEX))
    for layout, got in _both_layouts(cm, hist, padding, cand, INDEX).items():
        torch.testing.assert_close(got, want, **TOL, msg=layout)


def test_ragged_requests_and_a_fully_padded_history():
    """A fully padded row counts as left aligned: eager still nests, and that row is zeros."""
    model, cm = _compiled()
    hist, padding = _requests([2, 0, 5, 6, 3], seed=3)
    index = torch.tensor([4, 1, 1, 0, 2, 2, 2, 2, 3])
    cand = _candidates(index.shape[0], seed=4)
    want = _eager(model, hist, padding, cand, index)
    _assert_meaningful(want, _padded_path(model, hist, padding, cand, index))
    for layout, got in _both_layouts(cm, hist, padding, cand, index).items():
        torch.testing.assert_close(got, want, **TOL, msg=layout)


def test_a_history_with_a_hole_keeps_the_padded_values_for_the_whole_batch():
    """One row that is not left aligned makes eager take the padded path for every row; the
    same compiled model nests the aligned batch before and after (a decision per call)."""
    model, cm = _compiled()
    hist, aligned = _requests([6, 3, 2, 3], seed=5)
    padding = aligned.clone()
    padding[2] = torch.tensor([True, False, False, True, True, True])  # left padding
    padding[3, 1] = True  # a hole
    cand = _candidates(INDEX.shape[0], seed=6)
    want = _eager(model, hist, padding, cand, INDEX)
    nested = _eager(model, hist, aligned, cand, INDEX)
    _assert_meaningful(want, nested)
    torch.testing.assert_close(want, _padded_path(model, hist, padding, cand, INDEX), **TOL)
    for mask, expected, what in ((aligned, nested, "aligned"), (padding, want, "hole"),
                                 (aligned, nested, "aligned again")):  # fmt: skip
        for layout, got in _both_layouts(cm, hist, mask, cand, INDEX).items():
            torch.testing.assert_close(got, expected, **TOL, msg=f"{what}, {layout}")


def test_a_request_without_candidates_is_not_part_of_eagers_batch():
    """Request 1 has a hole but no candidate: the replicated batch eager sees has no row of it,
    so eager nests, and so must the shared call."""
    model, cm = _compiled()
    hist, padding = _requests([6, 3, 1, 4], seed=7)
    padding[1, 0] = True
    index = torch.tensor([0, 2, 2, 3, 0, 3, 3])
    cand = _candidates(index.shape[0], seed=8)
    want = _eager(model, hist, padding, cand, index)
    _assert_meaningful(want, _padded_path(model, hist, padding, cand, index))
    with torch.no_grad():
        got = cm(hist=hist, padding=padding, cand=cand, candidate_to_request=index)
    torch.testing.assert_close(got, want, **TOL)


def test_the_fast_path_switched_off_at_call_time():
    model, cm = _compiled()
    hist, padding = _requests([6, 3, 1, 4], seed=9)
    cand = _candidates(INDEX.shape[0], seed=10)
    nested = _eager(model, hist, padding, cand, INDEX)
    with _fast_path(False):
        want = _eager(model, hist, padding, cand, INDEX)
        _assert_meaningful(want, nested)
        for layout, got in _both_layouts(cm, hist, padding, cand, INDEX).items():
            torch.testing.assert_close(got, want, **TOL, msg=layout)
    for layout, got in _both_layouts(cm, hist, padding, cand, INDEX).items():  # on again
        torch.testing.assert_close(got, nested, **TOL, msg=layout)


def test_a_float_padding_mask_and_mask_check_off():
    """An additive float mask pads where it is nonzero, as eager reads it; ``mask_check=False``
    follows the same path on an aligned batch."""
    model, cm = _compiled(mask_check=False)
    hist, padding = _requests([6, 3, 1, 4], seed=11)
    additive = torch.zeros(padding.shape).masked_fill(padding, float("-inf"))
    example = {"hist": hist[[0, 1]], "padding": additive[[0, 1]], "cand": _candidates(2)}
    cm_float = rocs.compile(model, ["hist", "padding"], example_kwargs=example)
    cand = _candidates(INDEX.shape[0], seed=12)
    want = _eager(model, hist, padding, cand, INDEX)
    _assert_meaningful(want, _padded_path(model, hist, padding, cand, INDEX))
    torch.testing.assert_close(_eager(model, hist, additive, cand, INDEX), want, **TOL)
    for layout, got in _both_layouts(cm_float, hist, additive, cand, INDEX).items():
        torch.testing.assert_close(got, want, **TOL, msg=f"float mask, {layout}")
    for layout, got in _both_layouts(cm, hist, padding, cand, INDEX).items():
        torch.testing.assert_close(got, want, **TOL, msg=f"mask_check=False, {layout}")


def test_the_encoder_still_runs_once_per_request():
    """The op is row-wise given the index: the encoder's matmuls and the op are placed on
    request rows, and the op reads ``candidate_to_request`` there."""
    _, cm = _compiled()
    nodes = list(cm.graph_module.graph.nodes)
    (op,) = [n for n in nodes if n.target == torch.ops.rocs.nested_padding.default]
    assert op.meta[PLACEMENT] == Role.REQUEST
    assert op.args[2].name == "candidate_to_request"
    encoder_matmuls = [
        n for n in nodes
        if n.target == torch.ops.aten.linear.default and "encoder" in str(n.meta["nn_module_stack"])
    ]  # fmt: skip
    assert len(encoder_matmuls) == 8  # 2 layers: in, out, and the two FFN projections
    assert all(n.meta[PLACEMENT] == Role.REQUEST for n in encoder_matmuls)
    report = cm.report(candidates=64, requests=4)
    assert not report.fallbacks, [(f.op, f.reason) for f in report.fallbacks]
    assert report.request_flops > report.candidate_flops


def _grad_mode_case(seed: int):
    """A compiled model, a batch, and eager's answer to it in grad mode (the padded path: the
    encoder's parameters require grad), checked far from the nested answer."""
    model, cm = _compiled()
    hist, padding = _requests([6, 3, 1, 4], seed=seed)
    cand = _candidates(INDEX.shape[0], seed=seed + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model(hist[INDEX], padding[INDEX], cand).detach()
    _assert_meaningful(want, _eager(model, hist, padding, cand, INDEX))
    return model, cm, hist, padding, cand, want


def test_a_call_whose_grad_check_blocks_the_path_keeps_the_padded_values():
    """In grad mode with the encoder's parameters requiring grad, eager keeps the padded path;
    the runtime states that for the call with ``fast_path_state`` of the parameters capture
    recorded."""
    model, cm, hist, padding, cand, want = _grad_mode_case(seed=13)
    params = [p for n, p in model.named_parameters() if n.startswith("encoder.layers.0.")]
    with fast_path_state(params):
        got = cm(hist=hist, padding=padding, cand=cand, candidate_to_request=INDEX)
    torch.testing.assert_close(got.detach(), want, **TOL)
    with torch.no_grad(), fast_path_state(params):  # no grad: nothing blocks the path
        got = cm(hist=hist, padding=padding, cand=cand, candidate_to_request=INDEX)
    torch.testing.assert_close(got, _eager(model, hist, padding, cand, INDEX), **TOL)


def test_a_grad_mode_call_follows_eagers_decision_by_itself():
    """The runtime decides per call, with no wrapper of the caller's: in grad mode with the
    encoder's parameters requiring grad, eager keeps the padded values (both layouts); once they
    are frozen (``requires_grad_(False)`` after compiling), eager nests again under grad."""
    model, cm, hist, padding, cand, want = _grad_mode_case(seed=15)
    shared = cm(hist=hist, padding=padding, cand=cand, candidate_to_request=INDEX)
    dropin = cm(hist=hist[INDEX], padding=padding[INDEX], cand=cand)
    torch.testing.assert_close(shared.detach(), want, **TOL)
    torch.testing.assert_close(dropin.detach(), want, **TOL)
    model.requires_grad_(False)
    nested = _eager(model, hist, padding, cand, INDEX)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(model(hist[INDEX], padding[INDEX], cand), nested)  # eager nests
    got = cm(hist=hist, padding=padding, cand=cand, candidate_to_request=INDEX)
    torch.testing.assert_close(got, nested, **TOL)


def test_the_request_cache_keeps_the_encoder_and_decides_the_zeros_per_call():
    """With a request cache the encoder's states are cached per request, and the zeros are
    decided per call, by the requests that call holds: a request cached in an aligned call and
    met again beside a history with a hole keeps its padded values, as eager does."""
    torch.manual_seed(0)
    model = HistoryRanker().eval()
    hist, padding = _requests([6, 3, 1])
    example = {"hist": hist[[0, 0, 1, 2]], "padding": padding[[0, 0, 1, 2]], "cand": _candidates(4)}
    cm = rocs.compile(
        model, ["hist", "padding"], example_kwargs=example, options={"autotune": False},
        request_cache=rocs.RequestCache(1 << 24, autotune=False),
    )  # fmt: skip
    hist, padding = _requests([6, 3, 1, 4], seed=21)
    holed = padding.clone()
    holed[3] = torch.tensor([True, False, False, False, True, True])  # request 3: a hole
    index = torch.tensor([0, 0, 1, 2, 2])
    cand = _candidates(index.shape[0], seed=22)
    aligned_want = _eager(model, hist, padding, cand, index)
    with torch.no_grad():
        got = cm(hist=hist[:3], padding=padding[:3], cand=cand, candidate_to_request=index)
    torch.testing.assert_close(got, aligned_want, **TOL)
    both = torch.tensor([0, 0, 1, 2, 2, 3])  # requests 0-2 again (cached), with request 3
    cand = _candidates(both.shape[0], seed=23)
    want = _eager(model, hist, holed, cand, both)
    _assert_meaningful(want, _eager(model, hist, padding, cand, both))
    with torch.no_grad():
        got = cm(hist=hist, padding=holed, cand=cand, candidate_to_request=both)
    torch.testing.assert_close(got, want, **TOL)
    assert cm.cache_stats()["hits"] == 3


def test_capture_records_the_parameters_eagers_grad_check_reads():
    """The first layer's parameters and those the encoder's input is computed from (``embed``);
    not the later layers', the final norm's or the MLP's."""
    from rocs_compiler.capture.trace import capture

    torch.manual_seed(0)
    model = HistoryRanker(norm=True).eval()
    hist, padding = _requests([6, 3])
    captured = capture(model, (), {"hist": hist, "padding": padding, "cand": _candidates(2)},
                       ["hist", "padding"])  # fmt: skip
    first = [f"encoder.layers.0.{n}" for n, _ in model.encoder.layers[0].named_parameters()]
    assert captured.nested_fast_path_params == sorted(first + ["embed.bias", "embed.weight"])


def test_the_eval_mode_program_of_a_training_compile():
    torch.manual_seed(0)
    model = HistoryRanker().train()
    hist, padding = _requests([6, 3, 1, 4], seed=15)
    example = {"hist": hist[[0, 0, 1]], "padding": padding[[0, 0, 1]], "cand": _candidates(3)}
    cm = rocs.compile(model, ["hist", "padding"], example_kwargs=example, training=True)
    cm.eval()
    cand = _candidates(INDEX.shape[0], seed=16)
    want = _eager(model, hist, padding, cand, INDEX)
    _assert_meaningful(want, _padded_path(model, hist, padding, cand, INDEX))
    for layout, got in _both_layouts(cm, hist, padding, cand, INDEX).items():
        torch.testing.assert_close(got, want, **TOL, msg=layout)


@pytest.mark.parametrize("portable", [False, True], ids=["plain", "portable"])
def test_exported_programs_give_eagers_answer(portable):
    model, cm = _compiled(norm=True)
    program = rocs.export(cm, portable=portable).module()
    hist, padding = _requests([6, 3, 1, 4], seed=17)
    cand = _candidates(INDEX.shape[0], seed=18)
    want = _eager(model, hist, padding, cand, INDEX)
    _assert_meaningful(want, _padded_path(model, hist, padding, cand, INDEX))
    with torch.no_grad():
        got = program(hist=hist, padding=padding, cand=cand, candidate_to_request=INDEX)
    torch.testing.assert_close(got, want, **TOL)
    holed = padding.clone()
    holed[3, 0] = True
    with torch.no_grad():
        got = program(hist=hist, padding=holed, cand=cand, candidate_to_request=INDEX)
    torch.testing.assert_close(got, _eager(model, hist, holed, cand, INDEX), **TOL)


def test_a_portable_program_in_onnx_runtime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    from torch.fx import _pytree as fx_pytree

    model, cm = _compiled(norm=True)
    program = rocs.export(cm, portable=True)
    session = ort.InferenceSession(rocs.export_onnx(program, tmp_path / "ranker.onnx"))
    cand = _candidates(INDEX.shape[0], seed=20)
    for lengths, hole in (([6, 3, 1, 4], False), ([5, 2, 6, 1], True)):
        hist, padding = _requests(lengths, seed=19)
        if hole:
            padding[0, 1] = True
        kwargs = {"hist": hist, "padding": padding, "cand": cand, "candidate_to_request": INDEX}
        flat = fx_pytree.tree_flatten_spec(((), kwargs), program.call_spec.in_spec)
        feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), flat)}
        (got,) = session.run(None, feeds)
        want = _eager(model, hist, padding, cand, INDEX)
        torch.testing.assert_close(torch.from_numpy(got), want, **TOL, msg=f"hole={hole}")


@pytest.mark.parametrize("call", ["dispatcher", "direct"])
def test_the_backward_follows_the_forwards_decision(call):
    """A forward blocked for its call (grad on, a parameter requiring grad) passes the gradient
    through unchanged, even when autograd runs the backward after the call returned; an open
    forward zeroes the gradient at the padding it zeroed."""
    from rocs_compiler.kernels import ROCS_OPS

    op = {
        "dispatcher": torch.ops.rocs.nested_padding.default,
        "direct": ROCS_OPS["nested_padding"].run_with_backward,
    }[call]
    states = torch.randn(3, L, D, requires_grad=True)
    padding = _padding([6, 3, 0])
    weight = torch.ones(1, requires_grad=True)
    grad = torch.randn(3, L, D)
    with fast_path_state([weight]):  # grad is enabled: blocked
        blocked = op(states, padding)
    open_ = op(states, padding)
    torch.testing.assert_close(blocked, states)
    assert blocked[padding].abs().sum() > 0 and open_[padding].abs().sum() == 0
    (through,) = torch.autograd.grad(blocked, states, grad)
    (zeroed,) = torch.autograd.grad(open_, states, grad)
    torch.testing.assert_close(through, grad)
    torch.testing.assert_close(zeroed, grad.masked_fill(padding.unsqueeze(-1), 0))


@pytest.mark.slow
@pytest.mark.parametrize("portable", [False, True], ids=["plain", "portable"])
def test_an_aot_inductor_package_gives_eagers_answer(portable, tmp_path):
    model, cm = _compiled(norm=True)
    path = rocs.aoti_package(rocs.export(cm, portable=portable), tmp_path / "ranker.pt2")
    runner = torch._inductor.aoti_load_package(path)
    cand = _candidates(INDEX.shape[0], seed=22)
    for lengths, hole in (([6, 3, 1, 4], False), ([5, 2, 6, 1], True)):
        hist, padding = _requests(lengths, seed=21)
        if hole:
            padding[0, 1] = True
        with torch.no_grad():
            got = runner(hist=hist, padding=padding, cand=cand, candidate_to_request=INDEX)
        want = _eager(model, hist, padding, cand, INDEX)
        if not hole:
            _assert_meaningful(want, _padded_path(model, hist, padding, cand, INDEX))
        torch.testing.assert_close(got, want, **TOL, msg=f"hole={hole}")
