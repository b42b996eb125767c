"""The models the exactness tests compare are far from constant.

A differential test can only fail if the outputs it compares differ more than its tolerance
between a right and a wrong computation. So every model those tests use (the zoo, and the
DeepCTR and TorchRec models of ``tests/integrations/``) must give outputs whose spread across
the candidates of one request, and across requests, is many times the tolerance its exactness
tests allow: ``atol + rtol * max |output|``.
"""

from __future__ import annotations

import pytest
import torch
from models_for_tests import ATOL, RTOL
from torch.utils import _pytree as pytree

from models_zoo import ZOO, deepctr_models, torchrec_models

MARGIN = 100
COUNTS = [6, 2, 9, 5, 7]
# torch.testing.assert_close's float32 default, used by the DeepCTR tests.
DEEPCTR_TOLERANCE = (1.3e-6, 1e-5)
# (rtol, atol) of the TorchRec tests' layout checks.
TORCHREC_TOLERANCE = (1e-5, 1e-6)
# Output leaves that are request-only by design (two_tower's user embedding): they vary across
# requests only.
REQUEST_ONLY = {("two_tower", 1)}


def _spread(leaf: torch.Tensor, index: torch.Tensor) -> tuple[float, float]:
    """(pooled standard deviation within requests, standard deviation of the request means),
    averaged over the output's columns."""
    rows = leaf.reshape(leaf.shape[0], -1).double()
    groups = [rows[index == r] for r in index.unique()]
    deviations = torch.cat([g - g.mean(0) for g in groups])
    within = (deviations.pow(2).sum(0) / (rows.shape[0] - len(groups))).sqrt()
    across = torch.stack([g.mean(0) for g in groups]).std(0)
    return float(within.mean()), float(across.mean())


def _assert_varies(name: str, out, index: torch.Tensor, rtol: float, atol: float) -> None:
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    assert leaves, f"{name}: no tensor outputs"
    for i, leaf in enumerate(leaves):
        tolerance = atol + rtol * float(leaf.abs().max())
        within, across = _spread(leaf, index)
        where = f"{name} output {i}"
        assert across > MARGIN * tolerance, (
            f"{where}: spread across requests {across:.3g} is not {MARGIN}x the tolerance "
            f"{tolerance:.3g}"
        )
        if (name, i) not in REQUEST_ONLY:
            assert within > MARGIN * tolerance, (
                f"{where}: spread across the candidates of a request {within:.3g} is not "
                f"{MARGIN}x the tolerance {tolerance:.3g}"
            )


@torch.no_grad()
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_outputs_vary(name):
    entry = ZOO[name]
    batch = entry.make_batch(COUNTS, seed=7, shuffle=True)
    out = entry.build(seed=0)(**batch.replicated())
    _assert_varies(name, out, batch.candidate_to_request, RTOL, ATOL)


@torch.no_grad()
@pytest.mark.parametrize("name", deepctr_models.MODELS + deepctr_models.TINY)
def test_deepctr_outputs_vary(name):
    pytest.importorskip("deepctr_torch")
    model, user, _ = deepctr_models.build(name)
    x, index = deepctr_models.draw(model, user, COUNTS, seed=1)
    _assert_varies(f"deepctr {name}", model(x), index, *DEEPCTR_TOLERANCE)


def _torchrec_model(name: str):
    if name == "history_sequence":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return torchrec_models.HistorySequence().eval()
    model, _, _ = torchrec_models.build(name.removeprefix("weighted_"), weighted="weighted" in name)
    return model


@torch.no_grad()
@pytest.mark.parametrize("name", [*torchrec_models.MODELS, "weighted_dlrm", "history_sequence"])
def test_torchrec_outputs_vary(name):
    pytest.importorskip("torchrec")
    batch = torchrec_models.draw(COUNTS, seed=1, weighted="weighted" in name)
    out = _torchrec_model(name)(batch.dense, batch.kjt)
    _assert_varies(f"torchrec {name}", out, batch.index, *TORCHREC_TOLERANCE)
