"""``glm_from_zero_blocks``: a model whose GLM masks were trained by hand (plain Linears with
exact-zero request blocks) becomes a structurally masked GLM model the compiler shares.

Oracle: the original hand-masked model, eager, on replicated ragged batches.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from models_for_tests import assert_outputs_match
from torch import nn

import rocs_compiler as rocs
from models_zoo import Batch, request_index
from rocs_compiler.transforms.layers import GLMLinear

D_U, D_I = 8, 8


class HandDCN(nn.Module):
    """``x0 = cat(user, item)``; two cross layers ``x <- x0 * W x + x``; an MLP; a score."""

    def __init__(self):
        super().__init__()
        self.user = nn.Linear(12, D_U)
        self.item = nn.Linear(6, D_I)
        self.cross = nn.ModuleList(nn.Linear(D_U + D_I, D_U + D_I) for _ in range(2))
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.out = nn.Linear(16, 1)

    def forward(self, user_feats, item_feats):
        x0 = torch.cat([self.user(user_feats), self.item(item_feats)], -1)
        x = x0
        for layer in self.cross:
            x = x0 * layer(x) + x
        return self.out(self.mlp(x)).squeeze(-1)


def _hand_masked(seed: int = 0) -> HandDCN:
    """The request-lane-from-candidate blocks zeroed by hand, as a training mask would keep them."""
    torch.manual_seed(seed)
    model = HandDCN().eval()
    with torch.no_grad():
        for layer in model.cross:
            layer.weight[:D_U, D_U:] = 0
        model.mlp[0].weight[:16, D_U:] = 0  # rows 0:16 read the user lanes 0:8 only
        model.mlp[2].weight[:8, 16:] = 0  # rows 0:8 read the request rows 0:16 only
    return model


def _example(rows: int = 8) -> dict:
    return {"user_feats": torch.randn(rows, 12), "item_feats": torch.randn(rows, 6)}


def _batch(counts: list[int], seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    kwargs = {
        "user_feats": torch.randn(len(counts), 12, generator=g),
        "item_feats": torch.randn(sum(counts), 6, generator=g),
    }
    index = request_index(counts, shuffle=seed % 2 == 1, generator=g)
    return Batch(kwargs, index, ("user_feats",))


def _check_both_layouts(cm, original: nn.Module, rounds: int = 13) -> None:
    """Compiled (shared and drop-in) equals the original on ragged batches; drop-in batches keep
    a request's candidates together, as detection needs."""
    for i in range(rounds):
        counts = [[3, 1, 5], [1], [4, 4], [2, 7, 1, 1]][i % 4]
        batch = _batch(counts, seed=i)
        with torch.no_grad():
            expected = original(**batch.replicated())
            shared = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
        assert_outputs_match(shared, expected, f"shared layout, counts {counts}")
        grouped = _batch(counts, seed=2 * i)  # an even seed: candidates in request order
        with torch.no_grad():
            expected = original(**grouped.replicated())
            dropin = cm(**grouped.replicated())
        assert_outputs_match(dropin, expected, f"drop-in, counts {counts}")


def test_hand_masked_dcn_shares_its_cross_layers_and_stays_exact():
    original = _hand_masked()
    example = _example()
    before = rocs.compile(original, ["user_feats"], example_kwargs=example).report()

    glm = rocs.glm_from_zero_blocks(original, ["user_feats"], example_kwargs=example)
    report = glm.rocs_glm_report
    assert set(report.transformed) == {"cross.0", "cross.1", "mlp.0", "mlp.2"}
    assert not report.refused and set(report.kept) == {"out"}
    assert "8x8 block exactly zero" in report.transformed["cross.0"]
    assert isinstance(glm.cross[0], GLMLinear) and type(glm.out) is nn.Linear
    assert glm.mlp[0].request_out == ((0, 16),) and glm.mlp[0].request_in == ((0, 8),)
    # Module names and weight values kept; the original's state dict loads.
    assert {n for n, _ in original.named_modules()} <= {n for n, _ in glm.named_modules()}
    assert torch.equal(glm.mlp[2].weight, original.mlp[2].weight)
    glm.load_state_dict(original.state_dict())
    assert not glm.training and original.training is False

    cm = rocs.compile(glm, ["user_feats"], example_kwargs=example)
    after = cm.report()
    assert after.request_flops > before.request_flops
    assert after.candidate_flops < before.candidate_flops
    _check_both_layouts(cm, original)


def test_a_block_with_one_nonzero_entry_is_not_converted():
    original = _hand_masked()
    with torch.no_grad():
        original.mlp[2].weight[5, 20] = 1e-3
    with pytest.warns(UserWarning, match="mlp.2: rows 0:8 x 16 candidate columns: 1 nonzero"):
        glm = rocs.glm_from_zero_blocks(original, ["user_feats"], example_kwargs=_example())
    report = glm.rocs_glm_report
    assert type(glm.mlp[2]) is nn.Linear and "mlp.2" not in report.transformed
    assert "largest |w| = 0.001" in report.refused["mlp.2"]
    assert set(report.transformed) == {"cross.0", "cross.1", "mlp.0"}
    cm = rocs.compile(glm, ["user_feats"], example_kwargs=_example(), options={"autotune": False})
    _check_both_layouts(cm, original, rounds=4)


def test_plain_weights_convert_nothing():
    torch.manual_seed(1)
    original = HandDCN().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        glm = rocs.glm_from_zero_blocks(original, "user_feats", example_kwargs=_example())
    report = glm.rocs_glm_report
    assert not report.transformed and not report.refused
    assert report.kept["cross.0"] == "no output row is zero on every candidate column"
    assert not any(isinstance(m, GLMLinear) for m in glm.modules())


def test_request_rows_ignore_an_infinite_candidate_feature():
    """The point of the structural mask: a request lane no longer reads candidate columns."""
    glm = rocs.glm_from_zero_blocks(_hand_masked(), ["user_feats"], example_kwargs=_example())
    x = torch.randn(4, 16)
    x[:, D_U:] = float("inf")
    with torch.no_grad():
        out = glm.cross[0](x)
    assert torch.isfinite(out[:, :D_U]).all()
