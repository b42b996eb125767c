"""Ops ATen does not tag pointwise, as models write them: ``torch.where(mask, 0.0, -1e4)`` (an
attention bias) and ``F.one_hot`` (user fields), and a registry check that no tensor overload of
an elementwise family is left without a rule.

The oracle is the original model on replicated inputs: compiled, in both layouts, on ragged
batches, it computes the same; and the request-side nodes are REQUEST in the report.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from models_for_tests import assert_outputs_match
from torch import nn

import rocs_compiler as rocs
from rocs_compiler.analysis import op_groups, role_rules

aten = torch.ops.aten

# (requests, candidate -> request): one request, ragged and unordered, a single candidate.
INDEXES = [(1, [0, 0, 0]), (3, [0, 0, 0, 1, 2, 2]), (3, [2, 0, 1, 0, 2]), (2, [1])]


class HistoryEncoder(nn.Module):
    """A BERT-style self-attention layer over the user's history, padding masked by an additive
    bias ``torch.where(ids != 0, 0.0, -1e4)``, pooled and scored against the item."""

    def __init__(self, d: int = 8, heads: int = 2):
        super().__init__()
        self.heads, self.dh = heads, d // heads
        self.emb = nn.Embedding(50, d, padding_idx=0)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.item = nn.Embedding(50, d)
        self.head = nn.Linear(2 * d, 1)

    def forward(self, history, item):
        b, length = history.shape
        h = self.emb(history)
        bias = torch.where(history != 0, 0.0, -1e4)[:, None, None, :]  # [B, 1, 1, L]
        q, k, v = self.qkv(h).view(b, length, 3, self.heads, self.dh).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.dh) + bias
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, length, -1)
        h = self.norm(h + self.out(ctx))
        pooled = h.mean(1)
        return self.head(torch.cat([pooled, self.item(item)], -1)).squeeze(-1)


class OneHotFields(nn.Module):
    """Two categorical user fields one-hot encoded into a Linear, then an item tower."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.classes = classes
        self.user = nn.Linear(2 * classes, 8)
        self.item = nn.Linear(4, 8)
        self.head = nn.Linear(16, 1)

    def forward(self, user_field, item):
        u = self.user(F.one_hot(user_field, self.classes).float().flatten(1))
        return self.head(torch.relu(torch.cat([u, self.item(item)], -1))).squeeze(-1)


def _history(rows: int, g: torch.Generator) -> torch.Tensor:
    ids = torch.randint(1, 50, (rows, 6), generator=g)
    lengths = torch.randint(1, 7, (rows, 1), generator=g)
    return ids * (torch.arange(6) < lengths)  # trailing padding, at least one id per row


MODELS = {
    "where_bias_attention": (
        HistoryEncoder,
        "history",
        lambda rows, g: _history(rows, g),
        lambda rows, g: torch.randint(0, 50, (rows,), generator=g),
        "where",
    ),
    "one_hot_fields": (
        OneHotFields,
        "user_field",
        lambda rows, g: torch.randint(0, 5, (rows, 2), generator=g),
        lambda rows, g: torch.randn(rows, 4, generator=g),
        "one_hot",
    ),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_untagged_ops_share_and_stay_exact(name):
    factory, request_name, make_request, make_candidate, op_word = MODELS[name]
    torch.manual_seed(0)
    model = factory().eval()
    g = torch.Generator().manual_seed(1)
    example = {request_name: make_request(3, g), "item": make_candidate(3, g)}
    cm = rocs.compile(model, [request_name], example_kwargs=example, options={"autotune": False})
    report = cm.report()
    marked = [n for n in report.nodes if op_word in n.op]
    assert marked and all(n.role == "REQUEST" for n in marked), [(n.op, n.role) for n in marked]
    assert report.request_share > 0.3, report.summary()
    for requests, index in INDEXES:
        index = torch.tensor(index)
        request, candidate = make_request(requests, g), make_candidate(len(index), g)
        with torch.no_grad():
            want = model(request[index], candidate)
            shared = cm(**{request_name: request}, item=candidate, candidate_to_request=index)
            dropin = cm(**{request_name: request[index]}, item=candidate)
        assert_outputs_match(shared, want, f"{name} shared {index.tolist()}")
        assert_outputs_match(dropin, want, f"{name} drop-in {index.tolist()}")


def test_one_hot_without_a_class_count_is_refused():
    """``one_hot(x)`` sizes its output by the batch's largest id: never row-wise."""

    class Ctx:
        def arg(self, name, default=None):
            return -1 if name == "num_classes" else default

    assert role_rules.lookup(aten.one_hot.default)(Ctx()) is not None


# ---------------------------------------------------------------------------------------------
# Registry: every tensor overload of an elementwise family


def _aten_packets():
    names = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("aten::")}  # fmt: skip
    for name in sorted(names):
        packet = getattr(torch.ops.aten, name, None)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            yield packet


def _on_tensors(op) -> bool:
    """Takes a tensor and returns tensors (not the TorchScript overloads on numbers)."""
    schema = op._schema
    takes = any(isinstance(a.type, torch.TensorType) for a in schema.arguments)
    returns = schema.returns
    gives = bool(returns) and all(isinstance(r.type, torch.TensorType) for r in returns)
    return takes and gives


def test_every_tensor_overload_of_an_elementwise_family_has_a_rule():
    """ATen tags ``where.self`` pointwise but not ``where.Scalar``: any untagged tensor overload
    of a family with a tagged one must have a rule (elementwise or its own), so none is missed
    when a model spells the op with a number."""
    missing = []
    for packet in _aten_packets():
        overloads = [getattr(packet, name) for name in packet.overloads()]
        if not any(torch.Tag.pointwise in op.tags for op in overloads):
            continue
        for op in overloads:
            if op_groups.is_mutating(op) or op_groups.is_random(op) or not _on_tensors(op):
                continue
            if role_rules.lookup(op) is None:
                missing.append(str(op))
    assert not missing, f"tensor overloads of elementwise families without a rule: {missing}"


@pytest.mark.parametrize(
    "op, args",
    [
        (aten.where.Scalar, (torch.rand(3, 2) > 0.5, 0.0, -1e4)),
        (aten.where.ScalarOther, (torch.tensor([True, False]), torch.randn(3, 2), 0.0)),
        (aten.where.ScalarSelf, (torch.tensor([True, False]), 1.0, torch.randn(3, 2))),
        (aten.masked_fill.Tensor, (torch.randn(3, 2), torch.rand(3, 2) > 0.5, torch.tensor(2.0))),
        (aten.rsub.Tensor, (torch.randn(3, 2), torch.randn(2))),
        (aten.true_divide.Scalar, (torch.randn(3, 2), 3)),
    ],
    ids=lambda x: str(x) if isinstance(x, torch._ops.OpOverload) else "",
)
def test_the_listed_overloads_are_elementwise_under_broadcasting(op, args):
    """The oracle: row ``i`` of the result is the op on row ``i`` of each batched operand."""
    assert op_groups.is_elementwise(op)
    out = op(*args)
    rows = [
        op(*[a[i] if isinstance(a, torch.Tensor) and a.dim() == 2 else a for a in args])
        for i in range(3)
    ]
    want = torch.stack([torch.broadcast_to(r, out.shape[1:]) for r in rows])
    torch.testing.assert_close(out, want)
