"""What the report's numbers mean: candidates per request in ``cm.report`` as in the CLI, no
broadcast mark on sizes, and modules whose work is counted in another module's nodes."""

import pytest
import torch
from torch import nn

import rocs_compiler as rocs


class TargetAttentionRanker(nn.Module):
    """A candidate query attends over the request's history through ``nn.MultiheadAttention``."""

    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(100, 16)
        self.self_attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, history, item):
        h = self.items(history)
        attended, _ = self.self_attn(self.items(item).unsqueeze(1), h, h, need_weights=False)
        return self.head(torch.cat([attended.squeeze(1), h.mean(1)], 1))


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    example = {"history": torch.randint(0, 100, (6, 5)), "item": torch.randint(0, 100, (6,))}
    return rocs.compile(TargetAttentionRanker().eval(), ["history"], example_kwargs=example)


def test_candidates_are_per_request_as_in_the_cli(compiled):
    report = compiled.report(candidates=16, requests=32)
    assert (report.num_candidates, report.num_requests) == (512, 32)
    assert report.ideal_speedup() == pytest.approx(report.ideal_speedup(512, 32))
    assert report.ideal_speedup() > 1.0
    assert "N=512 candidates (16 per request), R=32 requests" in report.summary()
    assert compiled.report(16, 32).ideal_speedup() == report.ideal_speedup()


@pytest.mark.parametrize("keyword", ["num_candidates", "num_requests"])
def test_the_keywords_that_counted_all_candidates_are_refused(compiled, keyword):
    with pytest.raises(TypeError, match=r"candidates= \(per request"):
        compiled.report(**{keyword: 16})


def test_sizes_are_not_marked_as_broadcast(compiled):
    nodes = compiled.report().nodes
    sizes = [n for n in nodes if n.op in ("aten.sym_size.int", "mul") and n.role == "REQUEST"]
    assert sizes, "the attention's batch-times-heads size should appear as a REQUEST node"
    assert not any(n.broadcast for n in sizes)
    assert any(n.broadcast for n in nodes if n.op == "aten.linear.default")


def test_a_module_applied_by_its_parent_names_where_its_work_is_counted(compiled):
    report = compiled.report()
    rows = {row.module: row for row in report.modules}
    out_proj = rows["self_attn.out_proj"]
    assert out_proj.params == 16 * 16 + 16 and out_proj.nodes == 0
    readers = out_proj.read_by.split(", ")
    assert readers and all(r.endswith("(self_attn)") for r in readers)
    node_names = {n.name: n for n in report.nodes}
    assert all(node_names[r.split(" ")[0]].op == "aten.linear.default" for r in readers)
    assert rows["self_attn"].read_by == "" and rows["head"].read_by == ""
    assert f"parameters read by {out_proj.read_by}" in report.to_html(views=[])
