"""The ``torch.compile`` door on PyTorch's fused transformer fast paths, and on graphs with
nothing to share.

In eval mode under ``no_grad`` dynamo traces ``nn.TransformerEncoderLayer`` and
``nn.MultiheadAttention`` as ``torch._transformer_encoder_layer_fwd`` and
``torch._native_multi_head_attention``; the backend replaces them by the plain ops they compute
(``backend/fast_paths.py``) and shares the encoder of the history once per request. The oracles:
the fused ops themselves, and the eager model on the replicated batch.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch import nn

import rocs_compiler as rocs
from models_zoo.user_models import HistoryTransformerRanker
from rocs_compiler.backend import fast_paths, unshared

B, L, E, H = 5, 7, 16, 4
COUNTS = ([3, 1, 17], [6], [2, 5, 1, 1], [1])  # R = 1 and R > 1, single-candidate requests


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _float(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask.shape).masked_fill(mask, float("-inf"))


def _masks() -> dict:
    padding = torch.zeros(B, L, dtype=torch.bool)
    padding[1, 4:] = True
    padding[2, :] = True  # a query that sees no key: NaN in the fused ops
    padding[3, ::2] = True
    causal = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    merged = _float(causal).view(1, 1, L, L) + _float(padding).view(B, 1, 1, L)
    return {
        "none": (None, None),
        "padding (bool)": (padding, 1),
        "padding (float)": (_float(padding), 1),
        "causal (bool)": (causal, 0),
        "causal (float)": (_float(causal), 0),
        "merged": (merged.expand(B, H, L, L), 2),
    }


def _close(a, b, what):
    torch.testing.assert_close(
        a, b, rtol=1e-5, atol=1e-5, equal_nan=True, msg=lambda m: f"{what}: {m}"
    )


@torch.no_grad()
def test_plain_ops_compute_what_the_fused_ops_compute():
    torch.manual_seed(0)
    x = torch.randn(B, L, E)
    attn = [torch.randn(3 * E, E) / 4, torch.randn(3 * E), torch.randn(E, E) / 4, torch.randn(E)]
    ffn = [torch.randn(E), torch.randn(E), torch.randn(E), torch.randn(E)]
    ffn += [torch.randn(32, E) / 4, torch.randn(32), torch.randn(E, 32) / 4, torch.randn(E)]
    for name, (mask, kind) in _masks().items():
        for weights, average in [(False, True), (True, True), (True, False)]:
            args = (x, x, x, E, H, *attn, mask, weights, average, kind)
            want = torch._native_multi_head_attention(*args)
            got = fast_paths.native_multi_head_attention(*args)
            _close(got[0], want[0], f"attention {name} weights={weights}")
            if weights:
                _close(got[1], want[1], f"attention weights {name} average={average}")
        for norm_first, gelu in itertools.product([False, True], [False, True]):
            args = (x, E, H, *attn, gelu, norm_first, 1e-5, *ffn, mask, kind)
            want = torch._transformer_encoder_layer_fwd(*args)
            got = fast_paths.transformer_encoder_layer_fwd(*args)
            _close(got, want, f"encoder layer {name} norm_first={norm_first} gelu={gelu}")


def _history_batch(counts, seed):
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(1, 1000, (len(counts), 20), generator=g)
    lengths = torch.randint(1, 21, (len(counts),), generator=g)
    history[torch.arange(20)[None] >= lengths[:, None]] = 0  # padding at the end
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    item = torch.randint(1, 1000, (index.numel(),), generator=g)
    return history, item, index


def _check_ranker(model, compiled):
    with torch.no_grad():
        for seed, counts in enumerate(COUNTS):
            history, item, index = _history_batch(counts, seed)
            want = model(history[index], item)
            _close(compiled(history[index], item), want, f"drop-in {counts}")
            with warnings.catch_warnings():
                if index.numel() > 1:  # dynamo specializes one row, which has nothing to share
                    warnings.simplefilter("error", UserWarning)  # warns when nothing was shared
                shared = rocs.shared_call(compiled, history, item, candidate_to_request=index)
            _close(shared, want, f"shared {counts}")


RANKERS = {
    "post-norm relu": {},
    "pre-norm gelu": {"norm_first": True, "activation": "gelu"},
    "sequence first": {"batch_first": False},
    "self-attention, no nested tensor": {"self_attention": True, "nested_tensor": False},
}


@pytest.mark.parametrize(
    "variant",
    [v if i == 0 else pytest.param(v, marks=pytest.mark.slow) for i, v in enumerate(RANKERS)],
)
def test_transformer_encoder_under_no_grad_is_shared_and_exact(variant):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nn.TransformerEncoder on norm_first and nested tensors
        model = HistoryTransformerRanker(**RANKERS[variant]).eval()
    backend = rocs.backend(["history"], inductor=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    _check_ranker(model, compiled)
    subgraph = backend.subgraphs[0]  # the dynamic graph (then the one-row graph)
    report = subgraph.compiled_model.report()
    assert report.request_flops > 50 * report.candidate_flops, report.summary()
    assert not [f for f in report.fallbacks if "no role rule" in f.reason], report.summary()


def test_a_graph_that_shares_nothing_warns_once_naming_the_op(monkeypatch):
    """Without the fast paths' replacement the encoder layer has no role rule: the graph
    shares nothing, says which op kept it from sharing, and runs as Inductor compiled it."""
    monkeypatch.setattr(fast_paths, "FAST_PATH_OPS", {})
    monkeypatch.setattr(unshared, "_WARNED", set())
    torch.manual_seed(0)
    model = HistoryTransformerRanker(nested_tensor=False).eval()
    backend = rocs.backend(["history"], inductor=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    history, item, index = _history_batch([3, 2], 0)
    with torch.no_grad(), pytest.warns(UserWarning, match="_transformer_encoder_layer_fwd"):
        _close(compiled(history[index], item), model(history[index], item), "first call")
    with torch.no_grad():
        _close(compiled(history[index], item), model(history[index], item), "second call")
    (subgraph,) = backend.subgraphs  # without Inductor the graph runs as it is: no retrace
    assert "no role rule for aten._transformer_encoder_layer_fwd" in subgraph.fallback_reason
    assert subgraph.plain is not None and not subgraph.variants
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # once
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=rocs.backend(["history"], inductor=False))
        _close(compiled(history[index], item), model(history[index], item), "second compile")


class _Mixed(nn.Module):
    """Request features meet the candidate's in the first op: nothing is request-only."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, user, item):
        return self.mlp(user * item).squeeze(-1)


@pytest.mark.parametrize("inductor", [False, True])
def test_a_graph_with_nothing_to_share_runs_as_inductor_compiled_it(inductor):
    torch.manual_seed(0)
    model = _Mixed().eval()
    backend = rocs.backend(["user"], inductor=inductor)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no op lacks a rule: nothing to warn of
        for counts in ([3, 1, 5], [4], [2, 6, 1]):
            index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
            user, item = torch.randn(len(counts), 8), torch.randn(len(index), 8)
            _close(compiled(user[index], item), model(user[index], item), f"{counts}")
    # The rewrite shared nothing: dynamo traced the frame once more, and the backend lowered
    # that graph as it is (with Inductor), without rewriting it.
    first, *rest = backend.subgraphs
    assert first.fallback_reason.startswith("nothing to share")
    assert len(rest) == (1 if inductor else 0)
    assert all(s.plain is not None and not s.variants for s in backend.subgraphs)
