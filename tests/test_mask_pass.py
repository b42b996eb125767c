"""The mask pass: linear layers with exactly-zero weight blocks keep request lanes shared."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

import rocs_compiler as rocs
from models_zoo.batch import Batch, request_index

REQ, CAND, HIDDEN_REQ, HIDDEN_CAND = 6, 5, 8, 7


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
    """Three layers whose first rows never read candidate lanes (zero blocks in the weights)."""

    def __init__(self, parametrized: bool):
        super().__init__()
        dims = [(REQ, CAND), (HIDDEN_REQ, HIDDEN_CAND), (HIDDEN_REQ, HIDDEN_CAND)]
        self.layers = nn.ModuleList()
        for (in_r, in_c), (out_r, out_c) in zip(dims, dims[1:] + [(2, 1)]):
            layer = nn.Linear(in_r + in_c, out_r + out_c)
            mask = _block_lower(out_r, out_c, in_r, in_c)
            if parametrized:
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
    kwargs = {"user": torch.randn(len(counts), REQ, generator=g), "item": torch.randn(len(idx), CAND, generator=g)}
    return Batch(kwargs, idx, ("user",))


def _compile(parametrized):
    torch.manual_seed(0)
    model = LaneMLP(parametrized).eval()
    cm = rocs.compile(model, ["user"], example_kwargs=_batch([3, 2]).replicated())
    return model, cm


def test_zero_blocks_make_request_lanes_and_stay_exact():
    for parametrized in (False, True):
        model, cm = _compile(parametrized)
        report = cm.report(num_candidates=100, num_requests=1)
        assert report.pass_counts["glm_split_rows"] == 3
        request_linears = [n for n in report.nodes if n.role == "REQUEST" and n.op == "aten.linear.default"]
        assert len(request_linears) >= 3, "each layer's request rows run once per request"
        assert report.ideal_speedup() > 1.3
        for counts in ([4, 1, 3], [1], [5]):
            batch = _batch(counts, seed=len(counts))
            with torch.no_grad():
                expected = model(**batch.replicated())
            shared = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
            torch.testing.assert_close(shared, expected, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(cm(**batch.replicated()), expected, rtol=1e-4, atol=1e-5)


def test_nonzero_block_is_not_split():
    torch.manual_seed(0)
    model = LaneMLP(False).eval()
    with torch.no_grad():
        model.layers[0].weight[0, -1] = 1e-3  # the first request row now reads a candidate lane
    cm = rocs.compile(model, ["user"], example_kwargs=_batch([3, 2]).replicated())
    # The first layer stays whole, so no later layer sees a request lane either.
    assert cm.report().pass_counts["glm_split_rows"] == 0
    batch = _batch([2, 3], seed=3)
    with torch.no_grad():
        expected = model(**batch.replicated())
    torch.testing.assert_close(
        cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request), expected, rtol=1e-4, atol=1e-5
    )
