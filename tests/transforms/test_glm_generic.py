"""``apply_glm`` on models that are not registered families: lanes, masks, training, exactness.

The oracle is the eager transformed model: compiled (shared layout, ragged batches) must equal
it, and request lanes must not move when candidate inputs do (non-interference).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from models_for_tests import assert_outputs_match
from torch import nn

import rocs_compiler as rocs
from rocs_compiler.capture.trace import capture
from rocs_compiler.analysis.driver import analyze
from rocs_compiler.analysis.segments import lane_ranges, request_columns, run_taints
from rocs_compiler.transforms.layers import GLMLinear, GroupLayerNorm
from models_zoo.user_models import Ranker


def _ragged(request: dict, candidate: dict, index: list[int]):
    index = torch.tensor(index)
    replicated = {**{k: v[index] for k, v in request.items()}, **candidate}
    return index, replicated


def _check_exact(model, cm, make, index):
    """Compiled (shared layout) equals eager on replicated inputs for a ragged batch."""
    request, candidate = make(max(index) + 1, len(index))
    idx, replicated = _ragged(request, candidate, index)
    with torch.no_grad():
        expected = model(**replicated)
        got = cm(**request, **candidate, candidate_to_request=idx)
    assert_outputs_match(got, expected, f"index {index}")


def _masked_entries(model: nn.Module) -> list[torch.Tensor]:
    return [(m.weight * (1 - m.mask)) for m in model.modules() if isinstance(m, GLMLinear)]


def _train(model, make, optimizer, steps: int = 3):
    model.train()
    for _ in range(steps):
        request, candidate = make(8, 8)
        _, replicated = _ragged(request, candidate, list(range(8)))
        loss = model(**replicated).float().pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def _ranker_batch(requests: int, candidates: int):
    return {"user_feats": torch.randn(requests, 128)}, {"item_feats": torch.randn(candidates, 32)}


# ---------------------------------------------------------------------------------------------
# The snippet


def test_ranker_snippet_transforms_trains_and_compiles_exactly():
    torch.manual_seed(0)
    vanilla = Ranker()
    glm = rocs.apply_glm(vanilla, request_inputs=["user_feats"], request_fraction=0.5)
    # Module names kept; the masked layers are GLM layers with the planned lanes.
    assert [n for n, _ in glm.named_children()] == ["user", "item", "mlp"]
    assert isinstance(glm.mlp[0], GLMLinear) and isinstance(glm.mlp[2], GLMLinear)
    assert (glm.mlp[0].in_request, glm.mlp[0].out_request) == (256, 256)
    assert (glm.mlp[2].in_request, glm.mlp[2].out_request) == (256, 128)
    assert type(glm.mlp[4]) is nn.Linear
    report = glm.rocs_glm_report
    assert set(report.transformed) == {"mlp.0", "mlp.2"} and set(report.kept) == {"mlp.4"}
    assert not report.refused
    # The original state dict loads, masked blocks zeroed.
    glm.load_state_dict(vanilla.state_dict())
    mask = glm.mlp[0].mask
    assert torch.equal(glm.mlp[0].weight, vanilla.mlp[0].weight * mask)
    # Training with weight decay keeps the masked blocks exactly zero.
    _train(glm, _ranker_batch, torch.optim.AdamW(glm.parameters(), 1e-2, weight_decay=0.1))
    _train(glm, _ranker_batch, torch.optim.SGD(glm.parameters(), 1e-2, momentum=0.9))
    assert all(torch.count_nonzero(m) == 0 for m in _masked_entries(glm))
    example = {"user_feats": torch.randn(3, 128), "item_feats": torch.randn(3, 32)}
    cm = rocs.compile(glm, ["user_feats"], example_kwargs=example)
    for index in ([0], [0, 0, 0, 1, 2, 2], [2, 0, 1, 0, 2]):
        _check_exact(glm, cm, _ranker_batch, index)
    # The compiler exploits the masks: most of the FLOPs run once per request.
    cm_vanilla = rocs.compile(vanilla.eval(), ["user_feats"], example_kwargs=example)
    glm_cost = cm.report(100, 1).amortized_flops(100)
    assert glm_cost < 0.5 * cm_vanilla.report(100, 1).amortized_flops(100)


def test_ranker_request_lanes_ignore_candidates_even_inf():
    """Structural zeros only: an inf candidate feature leaves the GLM request lanes finite in
    eager and in the compiled model, which agree everywhere (NaN included)."""
    torch.manual_seed(1)
    glm = rocs.apply_glm(Ranker(), ["user_feats"]).eval()
    user, item = torch.randn(2, 128), torch.randn(2, 32)
    item[1, 0] = float("inf")
    hidden = glm.mlp[:2](torch.cat([glm.user(user), glm.item(item)], dim=1))
    assert torch.isfinite(hidden[:, :256]).all()
    cm = rocs.compile(glm, ["user_feats"], example_kwargs={"user_feats": user, "item_feats": item})
    with torch.no_grad():
        assert_outputs_match(cm(user_feats=user, item_feats=item), glm(user, item), "inf")


def test_incidental_zeros_make_no_request_lanes():
    """A zero block in an ordinary weight is not a mask: the lane analysis reads no weights."""
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        lin.weight[:2, 2:] = 0

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, u, c):
            return self.lin(torch.cat([u, c], -1))

    model = Model().eval()
    example = {"u": torch.randn(3, 2), "c": torch.randn(3, 2)}
    cg = capture(model, (), example, ["u"])
    analyze(cg.graph_module, {cg.placeholder_of["u"]}, cg.batch_symbol)
    _, taints = run_taints(cg.graph_module, [example["u"], example["c"]])
    out = [n for n in cg.graph_module.graph.nodes if n.op == "call_function"][-1]
    assert lane_ranges(request_columns(taints[out])) == ()


class _BagTower(nn.Module):
    """A user tower over a dense input and an ``nn.EmbeddingBag`` of the history, then an item
    embedding: every input of ``mlp`` is request-side."""

    def __init__(self):
        super().__init__()
        self.user, self.hist = nn.Linear(8, 8), nn.EmbeddingBag(100, 8, mode="mean")
        self.item = nn.Embedding(100, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(32, 1)

    def forward(self, user, history, item):
        u = self.mlp(torch.cat([self.user(user), self.hist(history)], -1))
        return self.head(torch.cat([u, self.item(item)], -1)).squeeze(-1)


def test_a_layer_with_only_request_inputs_stays_a_dense_request_layer():
    """An ``nn.EmbeddingBag`` output is request-side for the lanes as for the compiler (its
    offsets are an ``arange`` over the batch, which depends on no input): ``mlp`` reads request
    lanes only and stays dense, and compiled it runs once per request."""
    torch.manual_seed(0)
    example = {
        "user": torch.randn(6, 8),
        "history": torch.randint(0, 100, (6, 5)),
        "item": torch.randint(0, 100, (6,)),
    }
    glm = rocs.apply_glm(_BagTower().eval(), ["user", "history"], example_kwargs=example,
                         request_fraction=0.5)  # fmt: skip
    report = glm.rocs_glm_report
    assert not report.transformed and not report.refused, str(report)
    assert set(report.kept) == {"head"}
    assert all(type(m) is nn.Linear for m in glm.mlp if not isinstance(m, nn.ReLU))
    cm = rocs.compile(glm, ["user", "history"], example_kwargs=example)
    mlp_roles = {n.role for n in cm.report().nodes if n.module.startswith("mlp")}
    assert mlp_roles == {"REQUEST"}, mlp_roles

    def make(r, n):
        return (
            {"user": torch.randn(r, 8), "history": torch.randint(0, 100, (r, 5))},
            {"item": torch.randint(0, 100, (n,))},
        )

    for index in ([0], [0, 0, 0, 1, 2, 2], [2, 0, 1, 0, 2]):
        _check_exact(glm, cm, make, index)


# ---------------------------------------------------------------------------------------------
# Refusals and reports


class _RawProduct(nn.Module):
    """A parameter product that is not an nn.Linear: apply_glm cannot mask it."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, 8) / width**0.5)

    def forward(self, x):
        return x @ self.weight


class _WithRawProduct(nn.Module):
    def __init__(self):
        super().__init__()
        self.user, self.item = nn.Linear(4, 6), nn.Linear(3, 6)
        self.raw = _RawProduct(12)
        self.head = nn.Linear(8, 1)

    def forward(self, user, item):
        return self.head(torch.relu(self.raw(torch.cat([self.user(user), self.item(item)], -1))))


def test_untransformable_layer_is_listed_with_its_reason():
    example = {"user": torch.randn(4, 4), "item": torch.randn(4, 3)}
    with pytest.warns(UserWarning, match="raw: matmul with parameters on mixed lanes"):
        glm = rocs.apply_glm(_WithRawProduct(), ["user"], example_kwargs=example)
    assert "_RawProduct" in glm.rocs_glm_report.refused["raw"]
    assert type(glm.raw) is _RawProduct
    cm = rocs.compile(glm.eval(), ["user"], example_kwargs=example)
    make = lambda r, n: ({"user": torch.randn(r, 4)}, {"item": torch.randn(n, 3)})  # noqa: E731
    _check_exact(glm, cm, make, [1, 0, 1, 1])


def test_inputs_that_cannot_be_inferred_ask_for_examples():
    class Model(nn.Module):
        def forward(self, user, item):
            return torch.cat([user, item], -1).sum(-1)

    with pytest.raises(ValueError, match="example_kwargs"):
        rocs.apply_glm(Model(), ["user"])


# ---------------------------------------------------------------------------------------------
# Generated stacks: user tower + item tower + concat + MLP / cross / FM, through apply_glm


class _Stack(nn.Module):
    """``user`` and ``item`` towers, concatenated in either order, then an interaction part."""

    def __init__(self, du, di, hidden, kind, user_first, norm, depth):
        super().__init__()
        self.kind, self.user_first = kind, user_first
        self.user = nn.Sequential(nn.Linear(5, du), nn.ReLU())
        self.item = nn.Sequential(nn.Linear(3, di), nn.ReLU())
        width = du + di
        self.norm = nn.LayerNorm(width) if norm else nn.Identity()
        if kind == "cross":
            self.cross = nn.ModuleList(
                nn.Sequential(nn.Linear(width, 4), nn.Linear(4, width)) for _ in range(depth)
            )
        elif kind == "fm":
            self.fields = (du + di) // 4
        layers, prev = [], width if kind != "fm" else self.fields**2
        for _ in range(depth):
            layers += [nn.Linear(prev, hidden), nn.ReLU()]
            prev = hidden
        self.mlp = nn.Sequential(*layers, nn.Linear(prev, 1))

    def forward(self, user, item):
        parts = [self.user(user), self.item(item)]
        x = torch.cat(parts if self.user_first else parts[::-1], -1)
        x = self.norm(x)
        if self.kind == "cross":
            x0 = x
            for layer in self.cross:
                x = x0 * layer(x) + x
        elif self.kind == "fm":
            f = x.unflatten(-1, (self.fields, 4))
            x = torch.bmm(f, f.transpose(1, 2)).flatten(1)
        return self.mlp(x)


@settings(
    max_examples=10,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    du=st.sampled_from([4, 8]),
    di=st.sampled_from([4, 8]),
    hidden=st.integers(2, 9),
    kind=st.sampled_from(["mlp", "cross", "fm"]),
    user_first=st.booleans(),
    norm=st.booleans(),
    depth=st.integers(1, 2),
    scale=st.sampled_from([1.0, 2.0]),
    seed=st.integers(0, 2**16),
)
def test_generated_stacks_transform_train_and_compile_exactly(
    du, di, hidden, kind, user_first, norm, depth, scale, seed
):
    torch.manual_seed(seed)
    model = _Stack(du, di, hidden, kind, user_first, norm and kind != "fm", depth)

    def make(r, n):
        return {"user": torch.randn(r, 5)}, {"item": torch.randn(n, 3)}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        glm = rocs.apply_glm(model, ["user"], request_scale=scale)
    report = glm.rocs_glm_report
    assert report.transformed, str(report)
    if norm and kind != "fm":
        assert isinstance(glm.norm, GroupLayerNorm)
    # Non-interference of the first masked layer's request lanes.
    _train(glm, make, torch.optim.Adam(glm.parameters(), 1e-2), steps=2)
    assert all(torch.count_nonzero(m) == 0 for m in _masked_entries(glm))
    request, candidate = make(3, 3)
    cm = rocs.compile(glm, ["user"], example_kwargs={**request, **candidate})
    _check_exact(glm, cm, make, [2, 0, 0, 1, 2])
    _check_exact(glm, cm, make, [0])
