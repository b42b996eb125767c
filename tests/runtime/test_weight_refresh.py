"""A compiled model computes with its original model's current weights.

Weights change after compiling (``load_state_dict``, optimizer steps, ``copy_``, a new
Parameter); the compiled model must then still equal the original on replicated inputs, in both
call layouts. And only structural zeros are exploited: an inf in a candidate feature gives what
the original gives (NaN through ``inf * 0`` in a plain layer, finite request lanes in a GLM
layer). Oracle: the eager original model, after the same change.
"""

from __future__ import annotations

import pytest
import torch
from models_for_tests import assert_outputs_match, check_both_conventions, eager
from torch import nn

import rocs_compiler as rocs
from models_zoo import ZOO
from rocs_compiler.transforms.layers import GLMLinear, GLMLinearCompression

torch.set_num_threads(1)

RAGGED = [([3, 1, 5], True), ([1], False)]


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(2, 4, generator=g)[[0, 0, 1]]  # two requests, replicated
    return u, torch.randn(3, 4, generator=g)


def _model(forward, **children) -> nn.Module:
    model = type("Model", (nn.Module,), {"forward": forward})()
    for name, child in children.items():
        setattr(model, name, child)
    return model.eval()


def _compile(model: nn.Module):
    u, c = _inputs()
    return rocs.compile(model, request_inputs=["u"], example_kwargs=dict(u=u, c=c))


def _assert_same(model, cm, what: str, seed: int = 1):
    """Compiled == eager, drop-in and shared layout (requests deduplicated)."""
    u, c = _inputs(seed)
    expected = eager(model, dict(u=u, c=c))
    assert_outputs_match(cm(u=u, c=c), expected, f"{what}, drop-in")
    shared = cm(u=u[[0, 2]], c=c, candidate_to_request=torch.tensor([0, 0, 1]))
    assert_outputs_match(shared, expected, f"{what}, shared layout")


def _head(s, u, c):
    return s.h(torch.cat([s.a(u), c], -1))


def _randomize(model: nn.Module) -> None:
    """``load_state_dict`` with new values for every parameter (buffers such as masks kept)."""
    params = dict(model.named_parameters())
    state = model.state_dict()
    model.load_state_dict({k: torch.randn_like(v) if k in params else v for k, v in state.items()})


# ---------------------------------------------------------------------------------------------
# The two issues' repros


def test_load_state_dict_reaches_folded_weight_slices():
    torch.manual_seed(0)
    model = _model(_head, a=nn.Linear(4, 4), h=nn.Linear(8, 3))
    cm = _compile(model)
    _randomize(model)
    _assert_same(model, cm, "after load_state_dict")


def test_inf_candidate_in_a_plain_linear_with_a_zero_block_gives_nan():
    torch.manual_seed(0)
    linear = nn.Linear(8, 2)
    with torch.no_grad():
        linear.weight[0, 4:] = 0  # incidental zeros: row 0 reads no candidate column
    model = _model(lambda s, u, c: s.l(torch.cat([u, c], -1))[:, 0], l=linear)
    cm = _compile(model)
    u, c = _inputs(1)
    c[0, 0] = float("inf")
    expected = eager(model, dict(u=u, c=c))
    assert expected[0].isnan()
    assert_outputs_match(cm(u=u, c=c), expected, "inf candidate")


def test_inf_candidate_in_a_glm_linear_stays_out_of_request_lanes():
    torch.manual_seed(0)
    model = _model(lambda s, u, c: s.g(torch.cat([u, c], -1)), g=GLMLinear(4, 4, 2, 3))
    cm = _compile(model)
    u, c = _inputs(1)
    c[0, 0] = float("inf")
    expected = eager(model, dict(u=u, c=c))
    assert expected[:, :2].isfinite().all(), "the forward skips the masked block"
    assert_outputs_match(cm(u=u, c=c), expected, "inf candidate, GLMLinear")
    shared = cm(u=u[[0, 2]], c=c, candidate_to_request=torch.tensor([0, 0, 1]))
    assert_outputs_match(shared, expected, "inf candidate, GLMLinear, shared layout")


# ---------------------------------------------------------------------------------------------
# Zoo models


def _zoo(name: str, glm: bool):
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.build().eval()
    if glm:
        model = rocs.apply_glm(model, entry.request_inputs).eval()
    example = entry.make_batch([4, 3], seed=11).replicated()
    return entry, model, rocs.compile(model, list(entry.request_inputs), example_kwargs=example)


def _check_zoo(entry, model, cm, what: str) -> None:
    for counts, shuffle in RAGGED:
        batch = entry.make_batch(counts, seed=5, shuffle=shuffle)
        check_both_conventions(cm, model, batch, f"{what} {counts}")


@pytest.mark.parametrize(
    "name, glm",
    [("dcnv2", False), ("dcnv2", True), ("wukong", True)],
    ids=["dcnv2", "glm_dcnv2", "glm_wukong"],
)
def test_load_state_dict_on_a_zoo_model(name, glm):
    entry, model, cm = _zoo(name, glm)
    _check_zoo(entry, model, cm, "before")
    torch.manual_seed(3)
    state = {  # every parameter moves; the GLM masks stay (they are the model's structure)
        k: v + 0.1 * torch.randn_like(v) if k in dict(model.named_parameters()) else v
        for k, v in model.state_dict().items()
    }
    model.load_state_dict(state)
    _check_zoo(entry, model, cm, "after load_state_dict")


def test_an_optimizer_step_on_a_glm_model():
    entry, model, cm = _zoo("dcnv2", True)
    masked = [m for m in model.modules() if isinstance(m, (GLMLinear, GLMLinearCompression))]
    assert masked
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    model.train()
    for step in range(2):
        loss = model(**entry.make_batch([4, 4], seed=step).replicated()).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    for m in masked:
        assert torch.count_nonzero(m.weight[: m.out_request, m.in_request :]) == 0
    _check_zoo(entry, model, cm, "after two AdamW steps")


# ---------------------------------------------------------------------------------------------
# Kinds of change


def test_a_zero_initialised_layer_filled_later():
    lin = nn.Linear(8, 3)
    nn.init.zeros_(lin.weight)
    nn.init.zeros_(lin.bias)
    model = _model(lambda s, u, c: s.l(torch.cat([u, c], -1)), l=lin)
    cm = _compile(model)
    with torch.no_grad():
        lin.weight.normal_()
        lin.bias.normal_()
    _assert_same(model, cm, "filled after compiling")


def test_copy_into_a_parameter_and_an_unchanged_call_reuse_the_program():
    torch.manual_seed(0)
    model = _model(_head, a=nn.Linear(4, 4), h=nn.Linear(8, 3))
    cm = _compile(model)
    _assert_same(model, cm, "compiled")
    program = cm._graph_runner()
    with torch.no_grad():
        model.h.weight.copy_(torch.randn(3, 8))
    _assert_same(model, cm, "after copy_")
    assert cm._graph_runner() is program, "in-place updates keep the program (no rebuild)"


def test_new_parameter_objects_and_modules_are_followed():
    torch.manual_seed(0)
    model = _model(_head, a=nn.Linear(4, 4), h=nn.Linear(8, 3))
    cm = _compile(model)
    model.h.weight = nn.Parameter(torch.randn(3, 8))
    _assert_same(model, cm, "a new Parameter")
    model.a = nn.Linear(4, 4)
    _assert_same(model, cm, "a new submodule")
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    _assert_same(model, cm, "load_state_dict(assign=True)")


def test_assigning_a_glm_weight_through_its_parametrization():
    torch.manual_seed(0)
    model = _model(lambda s, u, c: s.g(torch.cat([u, c], -1)), g=GLMLinear(4, 4, 2, 3))
    cm = _compile(model)
    model.g.weight = torch.randn(5, 8)  # right_inverse swaps the storage of the raw weight
    assert torch.count_nonzero(model.g.weight[:2, 4:]) == 0
    _assert_same(model, cm, "GLM weight assigned")


def test_replacements_the_graph_cannot_take_are_refused():
    torch.manual_seed(0)
    model = _model(_head, a=nn.Linear(4, 4), h=nn.Linear(8, 3))
    cm = _compile(model)
    u, c = _inputs()
    model.a, model.h = nn.Linear(4, 5), nn.Linear(9, 3)
    replaced = r"a\.weight .*shape \(5, 4\).*compile the model again"
    with pytest.raises(rocs.CompileError, match=replaced):
        cm(u=u, c=c)
    model.a, model.h = nn.Linear(4, 4), nn.Linear(8, 3, bias=False)
    with pytest.raises(rocs.CompileError, match=r"h\.bias is no longer a parameter"):
        cm(u=u, c=c)
    model.h = nn.Linear(8, 3)
    _assert_same(model, cm, "after restoring compatible weights")


def test_writes_through_data_need_refresh_weights():
    torch.manual_seed(0)
    model = _model(_head, a=nn.Linear(4, 4), h=nn.Linear(8, 3))
    cm = _compile(model)
    model.h.weight.data.copy_(torch.randn(3, 8))  # bypasses the version counter
    cm.refresh_weights()
    _assert_same(model, cm, "after .data writes and refresh_weights()")


def test_an_assignment_to_data_is_followed():
    """``p.data = x`` bumps no version counter but gives ``p`` another storage: the data
    pointers show it, and the compiled model reads the new tensor (a moved copy copies it)."""
    torch.manual_seed(0)
    model = _model(_head, a=nn.Linear(4, 4), h=nn.Linear(8, 3))
    cm = _compile(model)
    _assert_same(model, cm, "before")
    model.a.weight.data = torch.randn(4, 4)
    _assert_same(model, cm, "after a.weight.data = ...")
    moved = _compile(model).double()
    model.h.weight.data = torch.randn(3, 8)
    u, c = _inputs(2)
    expected = eager(model, dict(u=u, c=c))
    assert_outputs_match(moved(u=u.double(), c=c.double()).float(), expected, "moved copy")


def test_a_compiled_model_moved_to_another_dtype_keeps_following_its_original():
    torch.manual_seed(0)
    model = _model(_head, a=nn.Linear(4, 4), h=nn.Linear(8, 3))
    cm = _compile(model).double()
    _randomize(model)
    u, c = _inputs(1)
    expected = eager(model, dict(u=u, c=c)).double()
    torch.testing.assert_close(cm(u=u.double(), c=c.double()), expected, rtol=1e-5, atol=1e-5)


def test_every_folded_constant_equals_its_recipe():
    from rocs_compiler.ir.graph_meta import FOLD

    for name in ("dcnv2", "wukong"):
        _, _, cm = _zoo(name, True)
        gm = cm.graph_module
        folds = [n for n in gm.graph.nodes if n.op == "get_attr" and FOLD in n.meta]
        assert folds, f"{name}: no folded constants to check"
        for node in folds:
            recipe = node.meta[FOLD]
            assert not any(s.startswith("_folded") for s in recipe.sources), "recipes read weights"
            torch.testing.assert_close(
                recipe.evaluate(gm), getattr(gm, node.target), rtol=0, atol=0
            )
