"""``rocs.export`` exports the model as it is now, not as it was at the last call.

Train, then export, is the normal order: after an optimizer step, ``load_state_dict`` or a
reassigned parameter with no call in between, the exported program computes with the new weights,
folded constants included (the column slices ``split_linear`` makes of a weight, which only a
weight refresh evaluates again); after a change the guards refuse (a Python attribute forward
reads, a submodule of another class) the export is refused as a call would be. Oracle: the eager
model after the same change, on a ragged batch, through the plain, portable, loaded and ONNX
programs (the AOTInductor package: ``test_export_aoti_inputs.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rocs_compiler as rocs

COUNTS = [3, 1, 5]  # ragged: requests with 3, 1 and 5 candidates


class Head(nn.Module):
    """A request tower whose output is concatenated with the candidate's features into one
    linear layer: the layer's weight is split by columns into folded constants."""

    def __init__(self):
        super().__init__()
        self.tower = nn.Linear(4, 8)
        self.head = nn.Linear(16, 3)
        self.scale = 2.0

    def forward(self, user, item):
        return self.head(torch.cat([torch.relu(self.tower(user)), item], -1)) * self.scale


def _ragged_batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    index = torch.repeat_interleave(torch.arange(len(COUNTS)), torch.tensor(COUNTS))
    index = index[torch.randperm(index.shape[0], generator=g)]
    user = torch.randn(len(COUNTS), 4, generator=g) * 3
    item = torch.randn(index.shape[0], 8, generator=g) * 3
    return user, item, index


def _compiled():
    torch.manual_seed(0)
    model = Head().eval()
    user, item, index = _ragged_batch(seed=0)
    cm = rocs.compile(model, ["user"], example_kwargs={"user": user[index], "item": item})
    folded = [n.target for n in cm.graph_module.graph.nodes if n.op == "get_attr"]
    assert any("folded" in str(t) for t in folded), "the test needs a folded weight slice"
    return model, cm


def _optimizer_step(model: Head) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    user, item, index = _ragged_batch(seed=2)
    model(user[index], item).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _load_state_dict(model: Head) -> None:
    state = model.state_dict()
    model.load_state_dict({k: torch.randn_like(v) for k, v in state.items()})


def _new_parameter(model: Head) -> None:
    model.head.weight = nn.Parameter(torch.randn_like(model.head.weight))


def _same_class_submodule(model: Head) -> None:
    model.head = nn.Linear(16, 3)  # a new module of the class compiled: its weights are followed


CHANGES = {
    "optimizer step": _optimizer_step,
    "load_state_dict": _load_state_dict,
    "reassigned parameter": _new_parameter,
    "replaced by an equal module": _same_class_submodule,
}


def _eager(model, user, item, index):
    with torch.no_grad():
        return model(user[index], item)


@pytest.mark.parametrize("change", list(CHANGES))
def test_export_after_a_weight_change_exports_the_new_weights(change, tmp_path):
    model, cm = _compiled()
    user, item, index = _ragged_batch()
    with torch.no_grad():
        cm(user=user, item=item, candidate_to_request=index)  # the last call, before the change
    before = _eager(model, user, item, index)
    CHANGES[change](model)
    expected = _eager(model, user, item, index)
    assert (expected - before).abs().max() > 0.1, "the change must move the scores"
    for portable in (False, True):
        program = rocs.export(cm, portable=portable)
        rocs.save(program, tmp_path / f"{portable}.pt2")
        loaded = rocs.load(tmp_path / f"{portable}.pt2")
        with torch.no_grad():
            for got in (program.module()(user=user, item=item, candidate_to_request=index),
                        loaded(user, item, index)):  # fmt: skip
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_an_onnx_program_exported_after_load_state_dict_has_the_new_weights(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    model, cm = _compiled()
    user, item, index = _ragged_batch()
    _load_state_dict(model)
    path = rocs.export_onnx(rocs.export(cm, portable=True), tmp_path / "head.onnx")
    session = ort.InferenceSession(path)
    names = [i.name for i in session.get_inputs()]
    (got,) = session.run(None, dict(zip(names, [user.numpy(), item.numpy(), index.numpy()])))
    expected = _eager(model, user, item, index)
    torch.testing.assert_close(torch.from_numpy(got), expected, rtol=1e-4, atol=1e-5)


def _new_scale(model: Head) -> None:
    model.scale = 5.0


def _other_class_submodule(model: Head) -> None:
    model.tower = nn.Sequential(nn.Linear(4, 8))


@pytest.mark.parametrize("change", [_new_scale, _other_class_submodule])
def test_export_after_a_change_the_guards_refuse_is_refused(change):
    model, cm = _compiled()
    user, item, index = _ragged_batch()
    with torch.no_grad():
        cm(user=user, item=item, candidate_to_request=index)
    change(model)
    with torch.no_grad(), pytest.raises(rocs.CompileError, match="compile the model again"):
        cm(user=user, item=item, candidate_to_request=index)  # what a call does
    for portable in (False, True):
        with pytest.raises(rocs.CompileError, match="compile the model again"):
            rocs.export(cm, portable=portable)
