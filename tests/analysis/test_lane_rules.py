"""Lane rules come with role rules: one registry, and the two analyses agree.

Every op's lane (its taint rule in ``analysis/segments.py``) is declared where its role rule is
registered. The oracle here is the role analysis: over small captured graphs that exercise every
lane, a value the role analysis calls REQUEST or CONST gets no candidate taint from the lane
rules alone (``run_taints(trust_roles=False)``), so a transform reading lanes never calls a
request-side value candidate. A lane that no sample exercises fails the coverage test.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rocs_compiler
from rocs_compiler.analysis import role_rules, segments
from rocs_compiler.analysis.driver import analyze
from rocs_compiler.analysis.role_rules import Lane
from rocs_compiler.capture.trace import capture
from rocs_compiler.ir.graph_meta import ROLE
from rocs_compiler.ir.roles import Role
from rocs_compiler.kernels import embedding_bag_rows  # noqa: F401 - rocs::embedding_bag_rows

aten = torch.ops.aten


class Sample(nn.Module):
    """``forward(u [B, 6], ids [B, 4], c [B, 6]) = body(self, u, ids) + c``-ish: request-side
    work on ``u`` and ``ids``, then one candidate op so that the output is per candidate."""

    def __init__(self, body):
        super().__init__()
        self.body = body
        self.lin = nn.Linear(6, 6)
        self.w = nn.Parameter(torch.randn(6, 6), requires_grad=False)
        self.table = nn.Parameter(torch.randn(10, 6), requires_grad=False)
        self.bn = nn.BatchNorm1d(6)
        self.conv = nn.Conv1d(2, 2, 3, padding=1)

    def forward(self, u, ids, c):
        out = self.body(self, u, ids)
        return out.float().flatten(1).sum(-1, keepdim=True) + c


def _attention(m, u, ids):
    q = u.view(-1, 1, 2, 3)
    return F.scaled_dot_product_attention(q, q * 2, q + 1)


SAMPLES = {
    "elementwise": lambda m, u, ids: torch.tanh(u) * 2 + torch.where(u > 0, 0.0, -1e4),
    "movement": lambda m, u, ids: torch.cat(
        [u.view(-1, 2, 3).transpose(1, 2).flatten(1), u, torch.zeros(u.shape[0], 2)], 1
    ),
    "item": lambda m, u, ids: u.split([2, 4], -1)[1],
    "embedding": lambda m, u, ids: F.embedding(ids, m.table),
    "one_hot": lambda m, u, ids: F.one_hot(ids, 10),
    "embedding_bag_rows": lambda m, u, ids: torch.ops.rocs.embedding_bag_rows(m.table, ids, 1, 0),
    "linear": lambda m, u, ids: m.lin(u),
    "matmul": lambda m, u, ids: u @ m.w,
    "bmm": lambda m, u, ids: torch.bmm(u.view(-1, 2, 3), u.view(-1, 3, 2)),
    "addmm": lambda m, u, ids: torch.addmm(m.lin.bias, u, m.w),
    "einsum": lambda m, u, ids: torch.einsum("bk,kd->bd", u, m.w),
    "attention": _attention,
    "reduction": lambda m, u, ids: u.view(-1, 2, 3).sum(-1) + u.amax(-1, keepdim=True),
    "along_dim": lambda m, u, ids: torch.softmax(u, -1) + u.cumsum(-1),
    "trailing_norm": lambda m, u, ids: F.layer_norm(u, (6,)),
    "whole": lambda m, u, ids: (
        u.var(-1, keepdim=True) + m.bn(u)
        + torch.gather(u, 1, ids.clamp(max=5)).sum(-1, keepdim=True)
        + m.conv(u.view(-1, 2, 3)).flatten(1).sum(-1, keepdim=True)
    ),
}


def _inputs(rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    return {
        "u": torch.randn(rows, 6, generator=g),
        "ids": torch.randint(0, 10, (rows, 4), generator=g),
        "c": torch.randn(rows, 6, generator=g),
    }


def _rule_taints(name: str):
    """(graph module, taints from the lane rules alone) of a sample, roles in the meta."""
    torch.manual_seed(0)
    model = Sample(SAMPLES[name]).eval()
    example = _inputs(3)
    captured = capture(model, (), example, ["u", "ids"])
    gm = captured.graph_module
    request = {captured.placeholder_of[n] for n in captured.request_inputs}
    analyze(gm, request, captured.batch_symbol)
    inputs = [example[n] for n in captured.input_names]
    _, taints = segments.run_taints(gm, inputs, trust_roles=False)
    return gm, taints


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_request_values_have_no_candidate_taint(name):
    gm, taints = _rule_taints(name)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta[ROLE] > Role.REQUEST:
            continue
        leaves = [t for t in torch.utils._pytree.tree_leaves(taints[node]) if t is not None]
        assert not any(bool(t.any()) for t in leaves), (
            f"{node.target} is {node.meta[ROLE].name} but its lane "
            f"{role_rules.lane_of(node.target)} taints it"
        )


def test_every_lane_is_exercised_by_a_request_node():
    seen = set()
    for name in SAMPLES:
        gm, _ = _rule_taints(name)
        seen |= {
            role_rules.lane_of(n.target)
            for n in gm.graph.nodes
            if n.op == "call_function" and n.meta[ROLE] == Role.REQUEST
        }
    assert set(Lane) <= seen, f"lanes without a sample: {set(Lane) - seen}"


def test_every_lane_has_a_taint_rule():
    assert set(segments._TAINTS) == set(Lane)


def test_an_op_without_a_role_rule_has_no_lane():
    assert role_rules.lookup(aten.hstack.default) is None
    assert role_rules.lane_of(aten.hstack.default) is None


def test_a_lookup_row_reads_only_its_own_ids():
    """``embedding(cat([ids_u, ids_c], 1))``: the request positions stay request-side."""
    mixed = _MixedLookup().eval()
    example = {"ids": torch.randint(0, 10, (3, 4)), "c": torch.randint(0, 10, (3, 2))}
    captured = capture(mixed, (), example, ["ids"])
    gm = captured.graph_module
    analyze(gm, {captured.placeholder_of["ids"]}, captured.batch_symbol)
    _, taints = segments.run_taints(gm, [example[n] for n in captured.input_names])
    (lookup,) = [n for n in gm.graph.nodes if n.target == aten.embedding.default]
    assert taints[lookup].shape == (3, 6, 5)
    assert not taints[lookup][:, :4].any() and taints[lookup][:, 4:].all()


class _MixedLookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(10, 5)

    def forward(self, ids, c):
        return self.table(torch.cat([ids, c], 1))


# ---------------------------------------------------------------------------------------------
# The registry's import direction: kernels register their ops' rules, analysis imports no kernel


def test_analysis_imports_nothing_from_kernels():
    root = pathlib.Path(rocs_compiler.__file__).parent / "analysis"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any("kernels" in n for n in names), f"{path.name} imports {names}"


def test_the_rocs_op_module_registers_its_own_rule():
    op = torch.ops.rocs.embedding_bag_rows.default
    assert role_rules.lookup(op) is role_rules.table_lookup_rule
    assert role_rules.lane_of(op) is Lane.LOOKUP
