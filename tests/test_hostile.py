"""Hostile models: each once gave a silent wrong answer or an unclear error. Every case is a
differential test against eager on a ragged batch, in both call layouts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rocs_compiler as rocs

INDEX = torch.tensor([0, 0, 1, 2, 2, 2, 1])  # 3 requests with 2, 2 and 3 candidates, shuffled


def module(forward, **children) -> nn.Module:
    """A module whose forward is ``forward(self, u, c)``, with the given children."""
    model = type("Hostile", (nn.Module,), {"forward": forward})()
    for name, child in children.items():
        setattr(model, name, child)
    return model.eval()


def assert_exact(model: nn.Module, u: torch.Tensor, c: torch.Tensor, **compile_kwargs):
    """Compile on a small replicated example; compare both layouts with eager on INDEX."""
    example = {"u": u[[0, 0, 1]], "c": c[:3]}
    cm = rocs.compile(model, ["u"], example_kwargs=example, **compile_kwargs)
    with torch.no_grad():
        want = model(u[INDEX], c)
        torch.testing.assert_close(cm(u=u, c=c, candidate_to_request=INDEX), want)
        torch.testing.assert_close(cm(u=u[INDEX], c=c), want)
    return cm


def test_matmul_of_a_concatenation_with_a_vector():
    """matmul(cat(request, candidate, dim=-2), vector) drops the vector dim: the distributed
    pieces concatenate along the output's last dim, not its batch dim."""

    def forward(s, u, c):
        x = torch.cat([s.a(u).view(-1, 2, 4), c.repeat(1, 2).view(-1, 2, 4)], 1)
        return torch.matmul(x, s.v)

    torch.manual_seed(0)
    model = module(forward, a=nn.Linear(4, 8), v=nn.Parameter(torch.randn(4)))
    cm = assert_exact(model, torch.randn(3, 4), torch.randn(7, 4))
    assert cm.report().pass_counts["distribute_matmul"] == 1


def test_python_numbers_computed_from_the_batch_size_follow_the_batch():
    def forward(s, u, c):
        return (u * c).sum(-1), c.shape[0] / 2, 1.5, c.shape[0] * 2

    model = module(forward)
    u, c = torch.randn(3, 4), torch.randn(7, 4)
    cm = rocs.compile(model, ["u"], example_kwargs={"u": u[[0, 0, 1]], "c": c[:3]})
    with torch.no_grad():
        want = model(u[INDEX], c)
        for got in (cm(u=u, c=c, candidate_to_request=INDEX), cm(u=u[INDEX], c=c)):
            torch.testing.assert_close(got[0], want[0])
            assert got[1:] == want[1:] == (3.5, 1.5, 14)
        program = rocs.export(cm)
        exported = program.module()(u=u, c=c, candidate_to_request=INDEX)
        assert exported[1:] == want[1:]


def test_einsum_with_a_broadcast_weight_dim():
    """A size-1 weight dim broadcasts in einsum: the split keeps it whole for every piece."""

    def forward(s, u, c):
        return torch.einsum("bi,ij->bj", torch.cat([s.a(u), c], -1), s.w)

    torch.manual_seed(0)
    model = module(forward, a=nn.Linear(4, 4), w=nn.Parameter(torch.randn(1, 5)))
    assert_exact(model, torch.randn(3, 4), torch.randn(7, 4))


def test_type_promotion_after_a_linear_is_not_fused():
    """float candidate linear + double request term: the add promotes, the fused GEMM cannot."""

    def forward(s, u, c):
        return s.i(c) + s.u(u).double()

    torch.manual_seed(0)
    model = module(forward, i=nn.Linear(4, 3), u=nn.Linear(4, 3))
    cm = assert_exact(model, torch.randn(3, 4), torch.randn(7, 4))
    assert cm.report().pass_counts.get("ikbo_linear", 0) == 0


def test_complex_request_inputs_in_drop_in_calls():
    torch.manual_seed(0)
    model = module(lambda s, u, c: (u.real * c).sum(-1) + u.imag.sum(-1))
    assert_exact(model, torch.randn(3, 4, dtype=torch.complex128), torch.randn(7, 4))


def test_an_index_on_another_device_is_refused_before_compute():
    torch.manual_seed(0)
    model = module(lambda s, u, c: (s.a(u) * c).sum(-1), a=nn.Linear(4, 4))
    cm = assert_exact(model, torch.randn(3, 4), torch.randn(7, 4))
    index = INDEX.to("meta")
    with pytest.raises(rocs.InputError, match="is on meta but the inputs are on cpu"):
        cm(u=torch.randn(3, 4), c=torch.randn(7, 4), candidate_to_request=index)


def test_report_of_a_model_with_data_dependent_shapes():
    def forward(s, u, c):
        return u[u.sum(-1) > 0].sum() + s.a(c).sum(-1)

    torch.manual_seed(0)
    model = module(forward, a=nn.Linear(4, 4))
    u, c = torch.randn(3, 4), torch.randn(7, 4)
    cm = rocs.compile(model, ["u"], example_kwargs={"u": u[[0, 0, 1]], "c": c[:3]})
    report = cm.report(candidates=64)
    assert report.candidate_flops > 0  # the linear on c is counted
    with torch.no_grad():
        torch.testing.assert_close(cm(u=u[INDEX], c=c), model(u[INDEX], c))


class WithValidateFlag(nn.Module):
    """A model keyword named like a runtime flag of other tools: it is the model's."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, u, c, validate=False):
        out = (self.a(u) * c).sum(-1)
        return out.clamp(-1.0, 1.0) if validate else out


def test_a_model_keyword_named_validate_reaches_the_model():
    torch.manual_seed(0)
    model = WithValidateFlag().eval()
    u, c = torch.randn(3, 4) * 3, torch.randn(7, 4)
    example = {"u": u[[0, 0, 1]], "c": c[:3], "validate": True}
    cm = rocs.compile(model, ["u"], example_kwargs=example)
    with torch.no_grad():
        want = model(u[INDEX], c, validate=True)
        assert not torch.equal(want, model(u[INDEX], c))  # the flag changes the result
        torch.testing.assert_close(cm(u=u, c=c, candidate_to_request=INDEX, validate=True), want)
        torch.testing.assert_close(cm(u=u[INDEX], c=c, validate=True), want)


def test_replicated_request_inputs_with_an_index_are_refused_not_misread():
    """One request row per candidate plus an index that groups candidates: the caller passed
    replicated inputs to the shared layout. Refused, never reinterpreted."""
    torch.manual_seed(0)
    model = module(lambda s, u, c: (s.a(u) * c).sum(-1), a=nn.Linear(4, 4))
    u, c = torch.randn(3, 4), torch.randn(7, 4)
    cm = assert_exact(model, u, c)
    with pytest.raises(rocs.InputError, match="one row per request"):
        cm(u=u[INDEX], c=c, candidate_to_request=INDEX)
    with torch.no_grad():
        torch.testing.assert_close(
            cm.call_replicated(u=u[INDEX], c=c, candidate_to_request=INDEX), model(u[INDEX], c)
        )


class TableLookup(nn.Module):
    """A [5, D] table passed to every call: with a 5-row example it looks batched."""

    def forward(self, u, c, table):
        return (u * c).sum(-1) + (c @ table.t()).amax(-1)


def test_an_unbatched_input_the_size_of_the_example_batch():
    torch.manual_seed(0)
    model = TableLookup().eval()
    u, c, table = torch.randn(3, 4), torch.randn(7, 4), torch.randn(5, 4)
    example = {"u": u[[0, 0, 1, 1, 2]], "c": c[:5], "table": table}
    taken_as_batched = rocs.compile(model, ["u"], example_kwargs=example)
    with pytest.raises(rocs.InputError, match="unbatched_inputs"):
        taken_as_batched(u=u[INDEX], c=c, table=table)
    cm = rocs.compile(model, ["u"], example_kwargs=example, unbatched_inputs=["table"])
    with torch.no_grad():
        want = model(u[INDEX], c, table)
        torch.testing.assert_close(cm(u=u, c=c, table=table, candidate_to_request=INDEX), want)
        torch.testing.assert_close(cm(u=u[INDEX], c=c, table=table), want)
    with pytest.raises(rocs.InputError, match="both request-side and unbatched"):
        rocs.compile(model, ["u"], example_kwargs=example, unbatched_inputs=["u"])
    with pytest.raises(rocs.InputError, match="unknown input name 'tabel'"):
        rocs.compile(model, ["u"], example_kwargs=example, unbatched_inputs=["tabel"])


def test_inputs_that_require_grad_are_refused_at_the_call():
    """A compiled model computes without autograd; asking for input gradients is refused at the
    call with the reason, not by a failing backward() later."""
    torch.manual_seed(0)
    model = module(lambda s, u, c: (s.a(u) * c).sum(-1), a=nn.Linear(4, 4))
    u, c = torch.randn(3, 4), torch.randn(7, 4)
    cm = assert_exact(model, u, c)
    c_grad = c.clone().requires_grad_()
    with pytest.raises(rocs.InputError, match="c require grad.*torch.no_grad"):
        cm(u=u, c=c_grad, candidate_to_request=INDEX)
    with torch.no_grad():  # the same inputs without autograd are fine
        got = cm(u=u, c=c_grad, candidate_to_request=INDEX)
        torch.testing.assert_close(got, model(u[INDEX], c))
    assert cm(u=u, c=c, candidate_to_request=INDEX).shape == (7,)  # grad mode, no grad inputs


def test_weights_that_require_grad_give_outputs_that_refuse_backward():
    """A model in eval mode whose parameters require grad (the default): the call works in grad
    mode, under no_grad and under inference_mode, with eager's values. In grad mode an output
    that eager would attach to a parameter carries a grad_fn whose backward says why there is no
    gradient, instead of a detached output that fails far from the cause."""
    torch.manual_seed(0)

    def forward(s, u, c):
        return {"score": (s.a(u) * c).sum(-1), "raw": (u * c).sum(-1), "ids": c.argmax(-1)}

    model = module(forward, a=nn.Linear(4, 4))
    u, c = torch.randn(3, 4), torch.randn(7, 4)
    cm = assert_exact(model, u, c)
    want = model(u[INDEX], c)
    got = cm(u=u, c=c, candidate_to_request=INDEX)
    for key in want:  # gradient-carrying exactly where eager's output is
        assert got[key].requires_grad == want[key].requires_grad, key
        torch.testing.assert_close(got[key].detach(), want[key].detach())
    with pytest.raises(RuntimeError, match="computes without autograd.*original model"):
        (got["score"] * 2).sum().backward()
    got["score"].mul_(2)  # in-place use of an output is as fine as in eager
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            assert not any(t.requires_grad for t in cm(u=u[INDEX], c=c).values())
    for p in model.parameters():
        p.requires_grad_(False)
    assert not cm(u=u, c=c, candidate_to_request=INDEX)["score"].requires_grad
    assert not c.requires_grad and cm(u=u, c=c, candidate_to_request=INDEX)["raw"].grad_fn is None
