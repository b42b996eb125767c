"""DeepCTR-Torch models, whose request features are column ranges of one packed input ``X``.

Each model (``models_zoo/deepctr_models.py``) is built from DeepCTR's own feature columns; its
request side (the user's features, and for DIN the behaviour history) is named by column range
from ``model.feature_index`` (``"X[:, 0:1]"``). Every model is compared with eager on ragged
batches in both call layouts, and the report's request FLOPs per request are checked against a
count derived by hand from the architecture.
"""

from __future__ import annotations

import pytest
import torch

import rocs_compiler as rocs

pytest.importorskip("deepctr_torch")
from models_zoo.deepctr_models import MODELS, build, draw, request_ranges  # noqa: E402


@pytest.mark.parametrize("name", MODELS)
def test_deepctr_model_with_request_columns(name):
    model, user, request_flops = build(name)
    example, _ = draw(model, user, [2, 1, 3], seed=0)
    compiled = rocs.compile(model, request_ranges(model, user), example_kwargs={"X": example})
    x, index = draw(model, user, [3, 1, 5, 2], seed=1)
    with torch.no_grad():
        want = model(x)
        for got in (compiled(X=x), compiled(X=x, candidate_to_request=index)):
            torch.testing.assert_close(got, want)
    report = compiled.report(candidates=64)
    assert not report.fallbacks, report.fallbacks
    assert report.request_flops == request_flops


def test_request_columns_that_vary_within_a_request_are_refused():
    model, user, _ = build("deepfm")
    (start, stop) = model.feature_index["user_id"]
    example, _ = draw(model, user, [2, 1], seed=0)
    compiled = rocs.compile(model, [f"X[:, {start}:{stop}]"], example_kwargs={"X": example})
    x, index = draw(model, user, [2, 2], seed=1)
    x[1, start] = x[0, start] + 1  # candidate 1 claims another user than candidate 0
    with pytest.raises(rocs.InputError, match="varies within a request|differ"):
        compiled(X=x, candidate_to_request=index)


# DIN's forward breaks dynamo's graph before its lookups: the frames after the break receive
# intermediate tensors that no request name reaches, so they run unshared (exact, with a reason).
BACKEND_SHARES = {"deepfm": True, "wdl": True, "dcn": True, "mmoe": True, "din": False}


# Through the backend (the models' rocs.compile tests cover all five): DeepFM for a graph dynamo
# traces whole, MMoE for multi-task heads, DIN for a graph break before its lookups.
@pytest.mark.parametrize("name", ["deepfm", "mmoe", "din"])
def test_deepctr_model_through_the_torch_compile_backend(name):
    torch._dynamo.reset()
    model, user, request_flops = build(name)
    backend = rocs.backend(request_ranges(model, user))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for counts, seed in (([3, 2, 4], 1), ([1, 5], 2), ([2, 2, 2, 1], 3)):
            x, _ = draw(model, user, counts, seed)
            torch.testing.assert_close(compiled(x), model(x))
    rewritten = [s.compiled_model for s in backend.subgraphs if s.compiled_model is not None]
    shared = sum(m.report(candidates=64).request_flops for m in rewritten)
    if BACKEND_SHARES[name]:
        assert shared == request_flops
    else:
        reasons = {s.fallback_reason for s in backend.subgraphs if s.compiled_model is None}
        assert reasons and reasons <= {
            "no request input reaches this graph",
            "nothing to share: every request value meets a candidate value first",
        }


def test_request_columns_from_feature_names_and_columns():
    from deepctr_torch.inputs import VarLenSparseFeat

    from rocs_compiler.integrations import deepctr as rocs_deepctr

    model, user, request_flops = build("din")
    by_name = rocs_deepctr.request_columns(model, user)
    assert by_name == sorted(request_ranges(model, user), key=lambda r: int(r[5:].split(":")[0]))
    history = [f for f in model.dnn_feature_columns if isinstance(f, VarLenSparseFeat)]
    others = [n for n in user if n not in {f.name for f in history} | {"seq_length"}]
    # A history column brings its length column along.
    assert rocs_deepctr.request_columns(model, others + history) == by_name
    example, _ = draw(model, user, [2, 1, 3], seed=0)
    compiled = rocs.compile(model, by_name, example_kwargs={"X": example})
    x, index = draw(model, user, [3, 1, 2], seed=5)
    with torch.no_grad():
        torch.testing.assert_close(compiled(X=x, candidate_to_request=index), model(x))
    assert compiled.report(candidates=64).request_flops == request_flops
    with pytest.raises(ValueError, match="'age_group' is not a feature of DIN; its features are"):
        rocs_deepctr.request_columns(model, ["user_id", "age_group"])
