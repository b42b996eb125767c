"""Masks: only structural zeros are exploited.

A GLM layer (``rocs_compiler.layers``) computes its request outputs from its request inputs alone,
so its request lanes are in the graph and run once per request. Zeros in ordinary weights, made
by hand or by a parametrization of a plain ``nn.Linear``, are not structure: the compiled model
computes those layers in full, like the original, so a refresh of the weights and an inf in a
candidate feature give the original's results. Oracle: the eager model on replicated inputs.
"""

import torch
import torch.nn.functional as F
from models_for_tests import assert_outputs_match
from torch import nn
from torch.nn.utils import parametrize

import rocs_compiler as rocs
from models_zoo.batch import Batch, request_index
from rocs_compiler.transforms.layers import GLMLinear

REQ, CAND, HIDDEN_REQ, HIDDEN_CAND = 6, 5, 8, 7
DIMS = [(REQ, CAND), (HIDDEN_REQ, HIDDEN_CAND), (HIDDEN_REQ, HIDDEN_CAND), (2, 1)]


class _Mask(nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, weight):
        return weight * self.mask


def _block_lower(out_r, out_c, in_r, in_c):
    mask = torch.ones(out_r + out_c, in_r + in_c)
    mask[:out_r, in_r:] = 0
    return mask


class LaneMLP(nn.Module):
    """Three layers whose first rows never read candidate lanes.

    ``kind``: "zeros" (plain weights with a zero block), "parametrized" (a plain ``nn.Linear``
    whose weight is parametrized with the mask) or "glm" (``GLMLinear`` layers).
    """

    def __init__(self, kind: str):
        super().__init__()
        self.layers = nn.ModuleList()
        for (in_r, in_c), (out_r, out_c) in zip(DIMS, DIMS[1:]):
            if kind == "glm":
                self.layers.append(GLMLinear(in_r, in_c, out_r, out_c))
                continue
            layer = nn.Linear(in_r + in_c, out_r + out_c)
            mask = _block_lower(out_r, out_c, in_r, in_c)
            if kind == "parametrized":
                parametrize.register_parametrization(layer, "weight", _Mask(mask))
            else:
                with torch.no_grad():
                    layer.weight.mul_(mask)
            self.layers.append(layer)

    def forward(self, user, item):
        x = torch.cat([user, item], dim=-1)
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


def _batch(counts, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = request_index(counts, shuffle=True, generator=g)
    kwargs = {
        "user": torch.randn(len(counts), REQ, generator=g),
        "item": torch.randn(len(idx), CAND, generator=g),
    }
    return Batch(kwargs, idx, ("user",))


def _compile(kind):
    torch.manual_seed(0)
    model = LaneMLP(kind).eval()
    cm = rocs.compile(model, ["user"], example_kwargs=_batch([3, 2]).replicated())
    return model, cm


def _check(model, cm, batch, what):
    with torch.no_grad():
        expected = model(**batch.replicated())
    shared = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    assert_outputs_match(shared, expected, f"{what}, shared layout")
    assert_outputs_match(cm(**batch.replicated()), expected, f"{what}, drop-in")
    return expected


def _request_linears(cm) -> int:
    report = cm.report(candidates=100)
    return sum(n.role == "REQUEST" and n.op == "aten.linear.default" for n in report.nodes)


def test_glm_layers_make_request_lanes_and_stay_exact():
    model, cm = _compile("glm")
    assert _request_linears(cm) >= 3, "each layer's request rows run once per request"
    assert cm.report(candidates=100).ideal_speedup() > 1.3
    for counts in ([4, 1, 3], [1], [5]):
        _check(model, cm, _batch(counts, seed=len(counts)), f"glm {counts}")


def test_zero_blocks_of_ordinary_weights_are_not_exploited():
    for kind in ("zeros", "parametrized"):
        model, cm = _compile(kind)
        # Only the first layer's request columns (split_linear) run per request.
        assert _request_linears(cm) == 1, kind
        for counts in ([4, 1, 3], [1]):
            _check(model, cm, _batch(counts, seed=len(counts)), f"{kind} {counts}")


def test_an_inf_candidate_propagates_like_the_original():
    for kind in ("zeros", "parametrized", "glm"):
        model, cm = _compile(kind)
        batch = _batch([2, 3], seed=3)
        batch.kwargs["item"][0, 0] = float("inf")
        expected = _check(model, cm, batch, kind)
        if kind == "glm":
            assert expected[:, :2].isfinite().all(), "the request lanes never read the candidate"
        else:
            assert expected[0].isnan().all(), "inf * 0 in the full-width layers"


def test_filling_a_zero_block_later_is_seen():
    model, cm = _compile("zeros")
    with torch.no_grad():
        model.layers[0].weight[0, -1] = 0.5  # the first request row now reads a candidate lane
    _check(model, cm, _batch([2, 3], seed=3), "after filling the zero block")
