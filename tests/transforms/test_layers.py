"""GLM and DCA layers: masks survive training, request outputs ignore candidates, and models
built from the layers compile exactly with their request lanes recognised.

Oracles: the masked block read back after optimizer steps; bit-identity of request outputs under
a perturbation of candidate inputs; the eager model on replicated inputs.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from models_for_tests import Spec, check_both_conventions, draw_batch
from torch import nn

import rocs_compiler as rocs
from rocs_compiler.transforms.layers import (
    DCABlock,
    GLMFactorizationMachine,
    GLMLinear,
    GLMLinearCompression,
    GroupLayerNorm,
    glm_mlp,
)

torch.set_num_threads(1)

OPTIMIZERS = {
    "sgd_weight_decay": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1),
    "adam_weight_decay": lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=0.1),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1),
}


def _masked_blocks(module: nn.Module):
    """(name, effective weight restricted to its masked block) for every GLM weight in module."""
    for name, sub in module.named_modules():
        if isinstance(sub, (GLMLinear, GLMLinearCompression)):
            yield name, sub.weight[: sub.out_request, sub.in_request :]


# ---------------------------------------------------------------------------------------------
# Masks


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_masked_blocks_stay_exactly_zero_during_training(optimizer):
    torch.manual_seed(0)
    fm = GLMFactorizationMachine(3, 2, 4, 2, 1, hidden=((6, 5),))
    lcb = GLMLinearCompression(3, 2, 2, 3)
    linear = GLMLinear(4, 3, 2, 5)
    params = [*fm.parameters(), *lcb.parameters(), *linear.parameters()]
    opt = OPTIMIZERS[optimizer](params)
    blocks = list(_masked_blocks(nn.ModuleList([fm, lcb, linear])))
    assert len(blocks) == 4
    for _ in range(5):
        x = torch.randn(8, 5, 4)
        loss = (
            fm(x).square().mean()
            + lcb(x).square().mean()
            + linear(torch.randn(8, 7)).square().mean()
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    for name, block in _masked_blocks(nn.ModuleList([fm, lcb, linear])):
        assert block.numel() > 0
        assert torch.count_nonzero(block) == 0, f"{name}: masked block changed"
    # the unmasked blocks did train
    assert torch.count_nonzero(linear.weight[2:, 4:]) > 0


def test_glm_linear_is_block_lower_triangular():
    layer = GLMLinear(3, 4, 2, 5)
    x = torch.randn(6, 7)
    w, b = layer.weight, layer.bias
    expected = torch.cat([F.linear(x[:, :3], w[:2, :3], b[:2]), F.linear(x, w[2:], b[2:])], dim=-1)
    torch.testing.assert_close(layer(x), expected)
    assert torch.count_nonzero(w[:2, 3:]) == 0 and torch.count_nonzero(w[:2, :3]) == 6


def test_assigning_weights_keeps_the_mask():
    layer = GLMLinear(2, 2, 1, 1)
    layer.weight = torch.ones(2, 4)
    assert torch.equal(layer.weight, torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]]))


@pytest.mark.parametrize(
    "make",
    [
        lambda: GLMLinear(0, 3, 1, 2),
        lambda: GLMLinearCompression(0, 3, 1, 1),
        lambda: GroupLayerNorm(0, 3),
    ],
    ids=["linear", "compression", "norm"],
)
def test_request_outputs_need_request_inputs(make):
    with pytest.raises(ValueError):
        make()


# ---------------------------------------------------------------------------------------------
# Non-interference: request outputs are bit-identical when candidate inputs change


def _perturbed(x: torch.Tensor, dim: int, start: int) -> torch.Tensor:
    y = x.clone()
    index = [slice(None)] * x.dim()
    index[dim] = slice(start, None)
    y[tuple(index)] = torch.randn_like(y[tuple(index)]) * 3
    return y


LANE_CASES = {
    # name: (layer, input shape, candidate dim and start, output dim and request width)
    "glm_linear": (lambda: GLMLinear(4, 3, 2, 5), (9, 7), (1, 4), (1, 2)),
    "group_layer_norm": (lambda: GroupLayerNorm(4, 3), (9, 7), (1, 4), (1, 4)),
    "glm_mlp": (
        lambda: glm_mlp((4, 3), [(5, 6), (2, 3)], last_activation=True),
        (9, 7),
        (1, 4),
        (1, 2),
    ),
    "linear_compression": (lambda: GLMLinearCompression(3, 2, 2, 4), (9, 5, 4), (1, 3), (1, 2)),
    "factorization_machine": (
        lambda: GLMFactorizationMachine(3, 2, 4, 2, 3, hidden=((6, 5),)),
        (9, 5, 4),
        (1, 3),
        (1, 2),
    ),
}


@pytest.mark.parametrize("case", list(LANE_CASES))
def test_request_lanes_ignore_candidate_inputs(case):
    make, shape, (cand_dim, cand_start), (out_dim, request_width) = LANE_CASES[case]
    torch.manual_seed(0)
    layer = make().eval()
    x = torch.randn(*shape)
    y = layer(x)
    y2 = layer(_perturbed(x, cand_dim, cand_start))
    assert torch.equal(y.narrow(out_dim, 0, request_width), y2.narrow(out_dim, 0, request_width))
    assert not torch.equal(y, y2)


def test_dca_block_history_and_request_streams_ignore_candidates():
    torch.manual_seed(0)
    block = DCABlock(8, 2, 16).eval()
    history, request, candidate = torch.randn(5, 6, 8), torch.randn(5, 2, 8), torch.randn(5, 1, 8)
    mask = torch.rand(5, 6) < 0.7
    mask[0] = False  # an empty history stays finite
    h1, c1, u1 = block(history, mask, candidate, request)
    h2, c2, u2 = block(history, mask, torch.randn(5, 1, 8), request)
    assert torch.equal(h1, h2) and torch.equal(u1, u2)
    assert not torch.equal(c1, c2)
    assert torch.isfinite(h1).all() and torch.isfinite(c1).all()


# ---------------------------------------------------------------------------------------------
# Models built from the layers compile exactly, with request lanes recognised

D = 4


class GLMStack(nn.Module):
    """user [B, 6] request, item [B, 5] candidate -> GLM MLP with a group norm -> logit."""

    def __init__(self):
        super().__init__()
        self.user = nn.Linear(6, 8)
        self.mlp = glm_mlp((8, 5), [(6, 6), (4, 4)], last_activation=True)
        self.norm = GroupLayerNorm(4, 4)
        self.last = GLMLinear(4, 4, 3, 3)
        self.head = nn.Linear(6, 1)

    def forward(self, user, item):
        x = torch.cat([torch.relu(self.user(user)), item], dim=-1)
        return self.head(torch.relu(self.last(self.norm(self.mlp(x))))).squeeze(-1)


class GLMFieldStack(nn.Module):
    """user [B, 3, D] request fields, item [B, 2, D] candidate fields -> FMB + LCB -> logit."""

    def __init__(self):
        super().__init__()
        self.fmb = GLMFactorizationMachine(3, 2, D, 2, 2, hidden=((8, 8),))
        self.lcb = GLMLinearCompression(3, 2, 2, 2)
        self.fmb2 = GLMFactorizationMachine(4, 4, D, 1, 1, hidden=((6, 6),))
        self.head = nn.Linear(2 * D, 1)

    def forward(self, user, item):
        x = torch.cat([user, item], dim=1)
        fmb, lcb = self.fmb(x), self.lcb(x)
        x = torch.cat([fmb[:, :2], lcb[:, :2], fmb[:, 2:], lcb[:, 2:]], dim=1)
        return self.head(self.fmb2(x).flatten(1)).squeeze(-1)


class DCAStack(nn.Module):
    """history ids [B, L] and profile [B, D2] request, item ids [B] candidate -> 2 DCA blocks."""

    def __init__(self, dim: int = 8, length: int = 5):
        super().__init__()
        self.items = nn.Embedding(30, dim, padding_idx=0)
        self.position = nn.Parameter(torch.randn(length, dim) * 0.1)
        self.profile = nn.Linear(6, 2 * dim)
        self.blocks = nn.ModuleList(DCABlock(dim, 2, 2 * dim) for _ in range(2))
        self.head = nn.Linear(4 * dim, 1)

    def forward(self, history, profile, item):
        h = self.items(history) + self.position
        u = self.profile(profile).unflatten(-1, (2, -1))
        c = self.items(item).unsqueeze(1)
        mask = history != 0
        for block in self.blocks:
            h, c, u = block(h, mask, c, u)
        return self.head(torch.cat([u.flatten(1), h.mean(1), c[:, 0]], dim=-1)).squeeze(-1)


MODEL_CASES = {
    "glm_stack": (
        GLMStack,
        {"user": Spec((6,)), "item": Spec((5,))},
        ("user",),
        ("mlp.0", "mlp.2", "last"),
    ),
    "glm_fields": (
        GLMFieldStack,
        {"user": Spec((3, D)), "item": Spec((2, D))},
        ("user",),
        ("fmb.mlp.0", "fmb.mlp.2", "fmb2.mlp.0", "fmb2.mlp.2"),
    ),
    "dca": (
        DCAStack,
        {"history": Spec((5,), vocab=30), "profile": Spec((6,)), "item": Spec((), vocab=30)},
        ("history", "profile"),
        ("blocks.1.history.query", "blocks.1.request.query", "blocks.1.candidate.key"),
    ),
}
BATCHES = [([3, 1, 5], True), ([1], False), ([2, 2, 1, 4, 1], True), ([9, 4, 11, 1, 7, 3], True)]


@functools.cache
def _compiled(name: str):
    factory, specs, request_inputs, _ = MODEL_CASES[name]
    torch.manual_seed(0)
    model = factory().eval()
    example = draw_batch(specs, request_inputs, [2, 3], seed=123).replicated()
    return name, model, rocs.compile(model, list(request_inputs), example_kwargs=example)


@pytest.fixture(scope="module", params=list(MODEL_CASES))
def compiled_case(request):
    return _compiled(request.param)


@pytest.mark.parametrize("counts, shuffle", BATCHES)
def test_compiled_equals_eager(compiled_case, counts, shuffle):
    name, model, cm = compiled_case
    _, specs, request_inputs, _ = MODEL_CASES[name]
    batch = draw_batch(specs, request_inputs, counts, seed=7, shuffle=shuffle)
    if name == "dca":
        batch.kwargs["history"][0] = 0  # an empty history
    check_both_conventions(cm, model, batch, name)


def test_request_lanes_are_recognised(compiled_case):
    name, _, cm = compiled_case
    report = cm.report(candidates=100)
    request_modules = {n.module for n in report.nodes if n.role == "REQUEST" and n.flops > 0}
    for module in MODEL_CASES[name][3]:
        assert module in request_modules, f"{name}: no request-side compute from {module}"
    assert not report.fallbacks


def test_dca_candidate_attention_reads_request_keys():
    _, _, cm = _compiled("dca")
    report = cm.report(candidates=100)
    assert "rocs.broadcast_attention.default" in report.fused_ops
    candidate_modules = {n.module for n in report.nodes if n.role == "CANDIDATE" and n.flops > 0}
    assert not any(m.startswith("blocks.1.history") or ".request." in m for m in candidate_modules)
