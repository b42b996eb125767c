"""The report a person reads: shape-only edges, named batch dims, batch axes, the per-module
table, the HTML page from Python and in notebooks, and the note on measured vs ideal speedups.

The page's script is tested in a browser by ``tests/report/test_report_browser.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from models_for_tests import D, VIEW_FROM_CANDIDATE_SIZE, zoo_compiled, zoo_model
from torch import nn

import rocs_compiler as rocs
from rocs_compiler.report.render.html import measured_note
from rocs_compiler.report.render.view import view_from_pipeline


def _edges(view, **flags):
    names = {n.id: n for n in view.nodes}
    return [
        (names[e.src], names[e.dst])
        for e in view.edges
        if all(getattr(e, k) == v for k, v in flags.items())
    ]


def test_a_size_taken_from_a_candidate_is_a_shape_only_edge():
    cm = VIEW_FROM_CANDIDATE_SIZE.compile()
    for graph in ("captured", "logical"):
        view = view_from_pipeline(cm.pipeline_result, graph=graph)
        shape = _edges(view, shape_only=True)
        assert any(s.name == "item" and d.role == "REQUEST" for s, d in shape), graph
        # The request-side view reads only the candidate's size: no data edge into it.
        data = _edges(view, shape_only=False)
        assert not any(s.name == "item" and d.role == "REQUEST" for s, d in data), graph
        assert not any(e.broadcast and e.shape_only for e in view.edges)


def test_shapes_name_the_batch_dim():
    report = VIEW_FROM_CANDIDATE_SIZE.compile().report()
    shapes = {n.name: n.shape for n in report.nodes}
    assert shapes["user"] == f"[B, 2, {D}]"
    assert all(not s or "s" not in s.strip("[]").split(",")[0] for s in shapes.values()), shapes


class SequenceFirst(nn.Module):
    """A request history run sequence-first, as ``nn.MultiheadAttention`` does: [L, B, D]."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, user, item):
        seq = self.proj(user.transpose(0, 1)).relu()  # [L, B, D]
        return seq.sum(0) * item


def test_request_values_show_their_batch_axis():
    cm = rocs.compile(
        SequenceFirst().eval(), ["user"],
        example_kwargs={"user": torch.randn(4, 3, D), "item": torch.randn(4, D)},
    )  # fmt: skip
    view = view_from_pipeline(cm.pipeline_result)
    axes = {
        n.op.split(".")[1]: n.axis for n in view.nodes if n.role == "REQUEST" and n.op != "input"
    }
    assert axes["relu"] == "requests along dim 1"
    assert axes["transpose"] == "requests along dim 1"


def test_module_table_counts_parameters_and_flops_per_side():
    report = zoo_compiled("dlrm").report()
    rows = {m.module: m for m in report.modules}
    model = zoo_model("dlrm")
    top_level = [m for m in report.modules if m.depth == 0]  # (top level) included
    assert sum(m.params for m in top_level) == sum(p.numel() for p in model.parameters())
    for name, child in model.named_children():
        if name in rows:
            assert rows[name].params == sum(p.numel() for p in child.parameters()), name
    assert sum(m.request_flops for m in top_level) == pytest.approx(report.request_flops)
    assert sum(m.candidate_flops for m in top_level) == pytest.approx(report.candidate_flops)
    assert any(m.request_flops for m in top_level) and any(m.candidate_flops for m in top_level)
    assert json.loads(report.to_json())["modules"][0]["module"] == report.modules[0].module


def test_to_html_and_notebook_display(tmp_path):
    report = zoo_compiled("dlrm").report(candidates=256)
    path = tmp_path / "dlrm.html"
    page = report.to_html(path, title="dlrm")
    assert path.read_text() == page
    assert page.startswith("<!DOCTYPE html>") and "<script>" in page
    data = page[page.index('id="rocs-data">') + len('id="rocs-data">') :]
    data = json.loads(data[: data.index("</script>")])
    assert [v["name"] for v in data["views"]] == ["captured", "logical"]
    captured, logical = data["views"]
    assert len(captured["nodes"]) < len(logical["nodes"]), "rewrites split the linears"
    frame = report._repr_html_()
    assert frame.startswith("<iframe srcdoc=") and "&lt;!DOCTYPE html&gt;" in frame


def test_measured_vs_ideal_is_explained():
    report = zoo_compiled("dlrm").report(candidates=256)
    ideal = report.ideal_speedup(256, 1)
    assert "FLOPs only" in measured_note(report, [(256, ideal)], 1)
    assert "exceeds" in measured_note(report, [(256, 3 * ideal)], 1)
    assert "falls short" in measured_note(report, [(256, ideal / 3)], 1)
