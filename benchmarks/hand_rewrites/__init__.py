"""The expert's hand rewrites of four models for the shared layout, for ``benchmarks/doors.py``.

Each rewrite is what a strong engineer would write in an afternoon for serving: an
``nn.Module`` built from the trained model (reusing its modules and weights, the weight splits
made once) whose forward takes the shared layout (request inputs at R rows, candidate inputs at N
rows, ``candidate_to_request`` int64 [N]) and runs the request-only work once per request,
gathering to the candidates only where a candidate needs it. Every rewrite exports
(``torch.export`` with R and N dynamic: no data-dependent shape, no Python loop over requests).

- ``dlrm``: :mod:`.dlrm`;
- ``glm_dcnv2``: DCNv2 after ``rocs.apply_glm(..., request_fraction=0.5)``, :mod:`.glm_dcn`;
- ``target_attention``: :mod:`.target_attention`;
- ``history_transformer``: an ``nn.TransformerEncoder`` history ranker,
  :mod:`.history_transformer`.

:func:`self_check` compares each rewrite with its original model on ragged, shuffled batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from models_zoo import ZOO

from . import history_transformer
from .dlrm import HandDLRM
from .glm_dcn import HandGLMDCN
from .history_transformer import HandHistoryTransformer
from .target_attention import HandTargetAttention

__all__ = ["CASES", "Case", "self_check"]


@dataclass(frozen=True)
class Case:
    """A model (``build()``: eval mode, fixed weights), its batches and its hand rewrite."""

    name: str
    request_inputs: tuple[str, ...]
    build: Callable[[], nn.Module]
    make_batch: Callable[..., object]  # (counts, *, seed, shuffle) -> models_zoo.Batch
    rewrite: Callable[[nn.Module], nn.Module]
    output_scale: float = 1.0  # the last linear's, so that scores spread over about +-1

    def model(self) -> nn.Module:
        """The model to compare: ``build()`` with its last linear layer scaled."""
        model = self.build()
        last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
        with torch.no_grad():
            last.weight.mul_(self.output_scale)
            if last.bias is not None:
                last.bias.mul_(self.output_scale)
        return model


def _glm_dcnv2() -> nn.Module:
    import rocs_compiler as rocs

    entry = ZOO["dcnv2"]
    model = rocs.apply_glm(entry.build(), list(entry.request_inputs), request_fraction=0.5)
    return model.eval()


def _zoo_case(name: str, rewrite, scale: float) -> Case:
    entry = ZOO[name]
    return Case(name, entry.request_inputs, entry.build, entry.make_batch, rewrite, scale)


CASES: dict[str, Case] = {
    "dlrm": _zoo_case("dlrm", HandDLRM, 100.0),
    "glm_dcnv2": Case(
        "glm_dcnv2",
        ZOO["dcnv2"].request_inputs,
        _glm_dcnv2,
        ZOO["dcnv2"].make_batch,
        HandGLMDCN,
        50.0,
    ),
    "target_attention": _zoo_case("target_attention", HandTargetAttention, 50.0),
    "history_transformer": Case(
        "history_transformer",
        history_transformer.REQUEST_INPUTS,
        history_transformer.build,
        history_transformer.make_batch,
        HandHistoryTransformer,
        5.0,
    ),
}

RAGGED: Sequence[Sequence[int]] = ([3, 1, 5], [7], [2, 9, 1, 4], [1, 1])


@torch.no_grad()
def self_check(names: Sequence[str] = tuple(CASES), rtol: float = 1e-4, atol: float = 1e-5):
    """Assert every rewrite equals its original model on ragged, shuffled batches."""
    for name in names:
        case = CASES[name]
        model = case.model()
        hand = case.rewrite(model).eval()
        for seed, counts in enumerate(RAGGED):
            batch = case.make_batch(counts, seed=seed, shuffle=True)
            want = model(**batch.replicated())
            got = hand(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=f"{name} {counts}")
