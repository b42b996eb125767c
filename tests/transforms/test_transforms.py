"""apply_glm / apply_dca: transformed models compile exactly and share more per request.

Oracles: the eager transformed model on replicated inputs (exactness of the compiled model), the
compiler's FLOP report of the original model (request share and amortized cost), and for HSTU
the original model itself (its DCA form is an exact rewrite).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from models_for_tests import assert_outputs_match, check_both_conventions, eager
from torch import nn

import rocs_compiler as rocs
from models_zoo import ZOO
from models_zoo import backbones as bb
from rocs_compiler.transforms.layers import GLMLinear, GLMLinearCompression
from rocs_compiler.transforms import register_glm_model
from rocs_compiler.transforms.glm import Lanes, glm_sequential
from rocs_compiler.transforms.registry import GLM_CONVERSIONS

torch.set_num_threads(1)

SCHEMA = bb.FeatureSchema(
    request_vocabs=(40, 8, 3), num_items=60, history_length=6, candidate_vocabs=(10,), multihot=5
)
SMALL = {
    bb.DCNv2Net: dict(emb_dim=4, num_cross=2, rank=6, deep=(16, 8)),
    bb.FinalMLPNet: dict(emb_dim=4, stream1=(16, 8), stream2=(16, 8), num_heads=2, gate_hidden=8),
    bb.WukongNet: dict(emb_dim=4, layers=((2, 2), (2, 2)), fmb_hidden=8, head=(16,)),
    bb.SequenceNet: dict(emb_dim=8, heads=2, ffn=16, num_layers=2, head=(8,)),
}
BATCHES = [([3, 1, 5], True), ([1], False), ([9, 4, 11, 1, 7, 3], True)]
MIN_CUT_AT_100 = 0.30  # amortized FLOPs per candidate at N = 100, transformed vs original


@dataclass(frozen=True)
class Target:
    build: Callable[[], nn.Module]
    make_batch: Callable[..., object]
    request_inputs: tuple[str, ...]
    transform: str  # "glm" or "dca"


def _zoo(name: str, transform: str) -> Target:
    entry = ZOO[name]
    return Target(entry.build, entry.make_batch, entry.request_inputs, transform)


def _backbone(cls, transform: str) -> Target:
    def build():
        torch.manual_seed(0)
        return cls(SCHEMA, **SMALL[cls]).eval()

    return Target(build, functools.partial(bb.random_batch, SCHEMA), bb.REQUEST_INPUTS, transform)


TARGETS = {
    "zoo_dcnv2": _zoo("dcnv2", "glm"),
    "zoo_finalmlp": _zoo("finalmlp", "glm"),
    "zoo_wukong": _zoo("wukong", "glm"),
    "zoo_bst": _zoo("bst", "dca"),
    "zoo_hstu": _zoo("hstu", "dca"),
    "dcnv2_net": _backbone(bb.DCNv2Net, "glm"),
    "finalmlp_net": _backbone(bb.FinalMLPNet, "glm"),
    "wukong_net": _backbone(bb.WukongNet, "glm"),
    "sequence_net": _backbone(bb.SequenceNet, "dca"),
}


def _transform(target: Target, model: nn.Module, scale: float = 1.0) -> nn.Module:
    torch.manual_seed(1)
    if target.transform == "dca":
        return rocs.apply_dca(model, target.request_inputs).eval()
    return rocs.apply_glm(model, target.request_inputs, request_scale=scale).eval()


def _compile(target: Target, model: nn.Module):
    example = target.make_batch([4, 3], seed=11).replicated()
    return rocs.compile(model, list(target.request_inputs), example_kwargs=example)


@functools.cache
def _compiled(name: str, scale: float = 1.0):
    target = TARGETS[name]
    original = target.build()
    transformed = _transform(target, original, scale)
    return original, _compile(target, original), transformed, _compile(target, transformed)


@pytest.fixture(scope="module", params=list(TARGETS))
def compiled(request):
    return request.param, *_compiled(request.param)


@pytest.mark.parametrize("counts, shuffle", BATCHES)
def test_transformed_model_compiles_exactly(compiled, counts, shuffle):
    name, _, _, model, cm = compiled
    batch = TARGETS[name].make_batch(counts, seed=5, shuffle=shuffle)
    check_both_conventions(cm, model, batch, name)


def test_transformed_model_shares_more_per_request(compiled):
    name, _, cm_original, _, cm = compiled
    before = cm_original.report(candidates=100)
    after = cm.report(candidates=100)
    assert after.request_share > before.request_share, name
    assert after.candidate_flops < before.candidate_flops, name
    cut = 1 - after.amortized_flops(100) / before.amortized_flops(100)
    assert cut >= MIN_CUT_AT_100, f"{name}: amortized FLOPs at N=100 cut by {cut:.1%} only"
    assert not after.fallbacks, f"{name}: {after.fallbacks}"


def test_hstu_dca_equals_hstu():
    original, _, transformed, _ = _compiled("zoo_hstu")
    for counts in ([3, 1, 5], [2]):
        kwargs = ZOO["hstu"].make_batch(counts, seed=3).replicated()
        kwargs["hist_item_ids"][0, :] = 0  # an empty history
        kwargs["hist_actions"][0, :] = 0
        assert_outputs_match(eager(transformed, kwargs), eager(original, kwargs), "HSTU as DCA")


def _lanes(model: nn.Module) -> list[tuple[int, int]]:
    return [(m.out_request, m.out_candidate) for m in model.modules() if isinstance(m, GLMLinear)]


def test_scaled_variant_widens_request_lanes_only():
    _, _, base, _ = _compiled("dcnv2_net")
    _, _, scaled, cm = _compiled("dcnv2_net", 3.0)
    for (r_base, c_base), (r_scaled, c_scaled) in zip(_lanes(base), _lanes(scaled)):
        assert c_scaled == c_base
        assert r_scaled >= r_base
    assert sum(r for r, _ in _lanes(scaled)) > sum(r for r, _ in _lanes(base))
    batch = bb.random_batch(SCHEMA, [3, 1, 5], seed=2, shuffle=True)
    check_both_conventions(cm, scaled, batch, "scaled DCNv2Net")


def test_transforms_leave_the_original_alone():
    model = ZOO["wukong"].build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rocs.apply_glm(model, ZOO["wukong"].request_inputs)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_base_variant_keeps_unchanged_layers_weights():
    model = ZOO["dcnv2"].build()
    glm = rocs.apply_glm(model, ZOO["dcnv2"].request_inputs)
    old, new = model.deep[0], glm.deep[0]
    assert isinstance(new, GLMLinear)
    assert torch.equal(new.weight, old.weight * new.mask)
    assert torch.equal(new.bias, old.bias)


def test_training_a_glm_model_keeps_masks():
    entry = ZOO["wukong"]
    model = rocs.apply_glm(entry.build(), entry.request_inputs).train()
    masked = [m for m in model.modules() if isinstance(m, (GLMLinear, GLMLinearCompression))]
    assert any(isinstance(m, GLMLinearCompression) for m in masked)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        out = model(**entry.make_batch([4, 4], seed=step).replicated())
        loss = out.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    for m in masked:
        assert torch.count_nonzero(m.weight[: m.out_request, m.in_request :]) == 0


# ---------------------------------------------------------------------------------------------
# Refusals


def test_apply_glm_asks_unregistered_models_for_examples():
    # No conversion: the generic path captures the model, which needs an example batch.
    with pytest.raises(ValueError, match="DLRM.*example_kwargs"):
        rocs.apply_glm(ZOO["dlrm"].build(), ZOO["dlrm"].request_inputs)


def test_apply_glm_refuses_unknown_layers():
    model = ZOO["dcnv2"].build()
    model.deep = nn.Sequential(nn.Linear(108, 64), nn.BatchNorm1d(64), nn.ReLU())
    model.head = nn.Linear(64, 1)
    with pytest.raises(ValueError, match=r"BatchNorm1d \(at deep\.1\)"):
        rocs.apply_glm(model, ZOO["dcnv2"].request_inputs)


def test_apply_glm_checks_request_inputs_and_arguments():
    entry = ZOO["finalmlp"]
    with pytest.raises(ValueError, match="request"):
        rocs.apply_glm(entry.build(), ["item_sparse"])
    with pytest.raises(ValueError, match="request_fraction"):
        rocs.apply_glm(entry.build(), entry.request_inputs, request_fraction=1.0)


def test_apply_dca_refuses_unknown_models_and_layers():
    with pytest.raises(ValueError, match="DCNv2"):
        rocs.apply_dca(ZOO["dcnv2"].build())
    bst = ZOO["bst"].build()
    bst.layers[1] = nn.TransformerEncoderLayer(32, 4, 128, batch_first=True)
    with pytest.raises(ValueError, match=r"TransformerEncoderLayer \(at layers\.1\)"):
        rocs.apply_dca(bst)


# ---------------------------------------------------------------------------------------------
# Registering a conversion


class _UserRanker(nn.Module):
    """A user's model: request and candidate features projected, concatenated, then an MLP."""

    def __init__(self):
        super().__init__()
        self.user = nn.Linear(3, 4)
        self.item = nn.Linear(2, 4)
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, user, item):
        return self.mlp(torch.cat([self.user(user), self.item(item)], dim=-1)).squeeze(-1)


def _register_user_ranker() -> None:
    def convert(model: nn.Module, groups: tuple[int, int], lanes: Lanes) -> None:
        model.mlp, _ = glm_sequential(model.mlp, groups, lanes, "mlp", output=True)

    register_glm_model(
        _UserRanker, request_inputs="user", groups=lambda m: (4, 4), convert=convert
    )


@pytest.fixture
def user_conversion():
    """``_UserRanker`` registered for the test only."""
    _register_user_ranker()
    yield
    del GLM_CONVERSIONS.conversions[_UserRanker]


def test_registered_user_conversion_converts_with_subclasses(user_conversion):
    class SubRanker(_UserRanker):
        pass

    torch.manual_seed(0)
    glm = rocs.apply_glm(SubRanker(), ["user"])
    hidden = glm.mlp[0]
    assert isinstance(hidden, GLMLinear)
    assert (hidden.out_request, hidden.out_candidate) == (4, 4)
    # Non-interference: the hidden layer's request lanes ignore the candidate features.
    user = torch.randn(5, 3)
    request_lanes = [
        glm.mlp[:2](torch.cat([glm.user(user), glm.item(torch.randn(5, 2))], dim=-1))[:, :4]
        for _ in range(2)
    ]
    assert torch.equal(*request_lanes)
    with pytest.raises(ValueError, match="request"):
        rocs.apply_glm(SubRanker(), ["item"])
    with pytest.raises(ValueError, match="already registered"):
        _register_user_ranker()


def test_backbone_conversion_module_loads_on_first_use(user_conversion):
    # A backbone names its conversion module in __rocs_conversions__; converting one loads it.
    glm = rocs.apply_glm(bb.DCNv2Net(SCHEMA, **SMALL[bb.DCNv2Net]), bb.REQUEST_INPUTS)
    assert not hasattr(glm, "rocs_glm_report")  # converted by its conversion, not the generic path
