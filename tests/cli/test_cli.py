"""The ``rocs`` command line: formats, targets, exit codes.

Commands run in-process through ``rocs_compiler.cli.main`` (one run goes through
``python -m rocs_compiler.cli``). Structure is checked, never generated node names.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from html.parser import HTMLParser

import pytest

from rocs_compiler.cli import main as cli, bench as cli_bench
from rocs_compiler.report.render import dot as dot_module
from conftest import run_cli as run

HAS_DOT = shutil.which("dot") is not None

FACTORY_MODULE = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Ranker(nn.Module):
        def __init__(self):
            super().__init__()
            self.user = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 16))
            self.item = nn.Embedding(100, 16)
            self.head = nn.Linear(32, 1)

        def forward(self, user_dense, item_id):
            u = self.user(user_dense)
            return self.head(torch.cat([u, self.item(item_id)], dim=1)).squeeze(-1)


    def _example():
        torch.manual_seed(0)
        index = torch.tensor([0, 0, 1, 2, 2, 2])
        return {"user_dense": torch.randn(3, 6)[index], "item_id": torch.randint(0, 100, (6,))}


    def make_ranker():
        torch.manual_seed(0)
        return Ranker().eval(), _example(), ["user_dense"]


    def make_ranker_without_names():
        torch.manual_seed(0)
        return Ranker().eval(), _example()
    """
)


@pytest.fixture
def factory_file(tmp_path, monkeypatch):
    path = tmp_path / "my_rankers.py"
    path.write_text(FACTORY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield path
    sys.modules.pop("my_rankers", None)




# -- help and usage -------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [[], ["inspect"], ["export"], ["zoo"], ["bench"]])
def test_help_everywhere(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--help"])
    assert exit_info.value.code == 0
    assert "usage: rocs" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect"],
        ["inspect", "models_zoo:dlrm", "--format", "png"],
        ["inspect", "models_zoo:dlrm", "--candidates", "0"],
        ["export", "models_zoo:dlrm"],
        ["zoo", "--bogus"],
        ["frobnicate"],
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["inspect", "models_zoo:dlrm", "--candidates", "ten"],
            "--candidates: expected a positive integer, got 'ten'",
        ),
        (
            ["inspect", "models_zoo:dlrm", "-o", "/nonexistent/dir/x.html"],
            "directory /nonexistent/dir does not exist",
        ),
        (
            ["export", "models_zoo:dlrm", "-o", "/nonexistent/dir/x.pt2"],
            "directory /nonexistent/dir does not exist",
        ),
    ],
)
def test_argument_errors_name_the_argument_before_compiling(argv, message, monkeypatch, capsys):
    import rocs_compiler.api

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled before checking the arguments")

    monkeypatch.setattr(rocs_compiler.api, "compile_graph", no_compile)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_no_command_prints_help_and_exits_2(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "usage: rocs" in err


# -- inspect: formats -----------------------------------------------------------------------------


def test_inspect_text_has_roles_and_summary(capsys):
    code, out, _ = run(
        capsys, "inspect", "models_zoo:dlrm", "--candidates", "64", "--requests", "2"
    )
    assert code == 0
    table = out.split("FLOPs per request")[0]
    for role in ("REQUEST", "CANDIDATE", "CONST"):
        assert f" {role} " in table
    assert "/req" in table and "/cand" in table, "FLOPs per request and per candidate"
    assert "bottom.0" in table, "source modules are named"
    for line in (
        "FLOPs per request",
        "FLOPs per candidate",
        "request share",
        "ideal speedup",
        "fused ops",
    ):
        assert line in out
    # --candidates is per request: 2 requests of 64 candidates are N = 128.
    assert "at N=128 candidates (64 per request), R=2 requests" in out


def test_inspect_json_parses_and_has_nodes(tmp_path, capsys):
    output = tmp_path / "dlrm.json"
    code, _, _ = run(capsys, "inspect", "models_zoo:dlrm", "--format", "json", "-o", str(output))
    assert code == 0
    data = json.loads(output.read_text())
    roles = {node["role"] for node in data["nodes"]}
    assert {"REQUEST", "CANDIDATE"} <= roles
    assert all({"name", "op", "module", "role", "flops"} <= node.keys() for node in data["nodes"])
    assert data["totals"]["request_flops"] > 0 and data["totals"]["candidate_flops"] > 0
    assert data["ideal_speedup"] > 1
    assert data["request_inputs"] == ["user_dense", "user_sparse"]
    assert any(edge["broadcast"] for edge in data["graph"]["edges"])


def test_inspect_dot(capsys):
    code, out, _ = run(capsys, "inspect", "models_zoo:dlrm", "--format", "dot")
    assert code == 0
    assert out.startswith("digraph")
    assert "subgraph cluster_REQUEST" in out and "subgraph cluster_CANDIDATE" in out
    assert "style=dashed" in out, "broadcast edges are marked"


@pytest.mark.skipif(not HAS_DOT, reason="Graphviz dot is not installed")
def test_inspect_svg_with_graphviz(tmp_path, capsys):
    output = tmp_path / "dlrm.svg"
    code, _, _ = run(
        capsys,
        "inspect",
        "models_zoo:dlrm",
        "--format",
        "svg",
        "--graph",
        "shared",
        "-o",
        str(output),
    )
    assert code == 0
    svg = _parse(output.read_text())
    assert {"role-REQUEST", "role-CANDIDATE"} <= svg.node_classes
    assert "fused" in svg.node_classes, "the shared graph shows the fused rocs:: ops"
    assert svg.broadcast_edges > 0


def test_svg_without_graphviz_exits_3(monkeypatch, capsys):
    monkeypatch.setattr(dot_module.shutil, "which", lambda name: None)
    code, _, err = run(capsys, "inspect", "models_zoo:dlrm", "--format", "svg")
    assert code == 3
    assert "Graphviz" in err and "Traceback" not in err


class _Structure(HTMLParser):
    """Collects what the tests check: svg elements, node classes, plot parts, table rows."""

    def __init__(self):
        super().__init__()
        self.svgs, self.depth = [], 0
        self.node_classes: set[str] = set()
        self.broadcast_edges = 0
        self.ideal_curves = self.measured_points = self.table_rows = 0
        self.sections: set[str] = set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = set((attrs.get("class") or "").split())
        if tag == "svg":
            self.svgs.append(classes)
        if tag == "section":
            self.sections.add(attrs.get("id"))
        if tag == "g" and "node" in classes:
            self.node_classes |= classes
        if "broadcast" in classes or (tag == "g" and "edge" in classes and "broadcast" in classes):
            self.broadcast_edges += 1
        if tag == "polyline" and "ideal" in classes:
            self.ideal_curves += 1
        if tag == "circle" and "measured" in classes:
            self.measured_points += 1
        if tag == "tr" and any(c.startswith("role-") for c in classes):
            self.table_rows += 1


def _parse(text: str) -> _Structure:
    parser = _Structure()
    parser.feed(text)
    parser.close()
    return parser


def _check_html(path) -> _Structure:
    text = path.read_text()
    assert text.startswith("<!DOCTYPE html>")
    # Self-contained: inline script and styles only, nothing fetched.
    assert "<script src" not in text and "<link" not in text
    assert "http://" not in text.replace("http://www.w3.org", "")
    assert "https://" not in text
    page = _parse(text)
    assert any("rocs-graph" in classes for classes in page.svgs), "the graph's drawing area"
    assert any("speedup-plot" in classes for classes in page.svgs)
    assert page.ideal_curves == 1
    assert page.table_rows > 10, "the node table"
    assert {"summary", "graph", "speedup", "modules", "nodes"} <= page.sections
    data = _embedded_data(text)
    kinds = [v["name"] for v in data["views"]]
    assert kinds[:2] == ["captured", "logical"], "the graph as written and after rewrites"
    logical = data["views"][1]
    assert {n["role"] for n in logical["nodes"]} >= {"REQUEST", "CANDIDATE"}
    assert any(kind == 1 for _, _, kind in logical["edges"]), "broadcast edges"
    return page


def _embedded_data(text: str) -> dict:
    start = text.index('<script type="application/json" id="rocs-data">')
    start = text.index(">", start) + 1
    return json.loads(text[start : text.index("</script>", start)])


def test_inspect_html_report(tmp_path, capsys):
    output = tmp_path / "report.html"
    code, _, _ = run(capsys, "inspect", "models_zoo:dlrm", "--format", "html", "-o", str(output))
    assert code == 0
    _check_html(output)
    assert _embedded_data(output.read_text())["default_view"] == "logical"


def test_inspect_html_report_with_the_shared_graph(tmp_path, capsys):
    output = tmp_path / "report.html"
    code, _, _ = run(
        capsys, "inspect", "models_zoo:dlrm", "--format", "html", "--graph", "shared",
        "-o", str(output),
    )  # fmt: skip
    assert code == 0
    data = _embedded_data(output.read_text())
    assert [v["name"] for v in data["views"]] == ["captured", "logical", "shared"]
    assert data["default_view"] == "shared"
    assert any(n["fused"] for n in data["views"][2]["nodes"])


def test_measure_adds_points_to_the_plot(factory_file, tmp_path, capsys):
    output = tmp_path / "measured.html"
    code, _, _ = run(
        capsys,
        "inspect",
        "my_rankers:make_ranker",
        "--format",
        "html",
        "--measure",
        "--candidates",
        "64",
        "--requests",
        "2",
        "-o",
        str(output),
    )
    assert code == 0
    page = _check_html(output)
    assert page.measured_points == 2  # N = 16 and 64


# -- targets --------------------------------------------------------------------------------------


def test_factory_targets_by_module_and_by_path(factory_file, capsys):
    code, out, _ = run(capsys, "inspect", "my_rankers:make_ranker", "--format", "json")
    assert code == 0
    data = json.loads(out)
    assert data["request_inputs"] == ["user_dense"]
    assert {n["role"] for n in data["nodes"]} >= {"REQUEST", "CANDIDATE"}

    code, out, _ = run(
        capsys, "inspect", f"{factory_file}:make_ranker_without_names", "--request", "user_dense"
    )
    assert code == 0 and "REQUEST" in out

    code, _, err = run(capsys, "inspect", f"{factory_file}:make_ranker_without_names")
    assert code == 1 and "--request" in err


def test_saved_export_target(tmp_path, capsys):
    path = tmp_path / "dlrm.pt2"
    code, _, _ = run(capsys, "export", "models_zoo:dlrm", "-o", str(path))
    assert code == 0 and path.is_file()
    code, out, _ = run(capsys, "inspect", str(path), "--format", "json", "--candidates", "128")
    assert code == 0
    data = json.loads(out)
    assert {n["role"] for n in data["nodes"]} >= {"REQUEST", "CANDIDATE"}
    assert data["fused_ops"], "the saved graph contains rocs:: fused ops"
    assert data["totals"]["request_flops"] > 0 and data["num_candidates"] == 128
    code, out, _ = run(capsys, "inspect", str(path))
    assert code == 0 and "saved export" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "models_zoo:no_such_model"], "unknown zoo model"),
        (["inspect", "models_zoo:dlrm", "--request", "user_dens"], "unknown input name"),
        (["inspect", "missing_file.pt2"], "no such file"),
        (["inspect", "no_colon_here"], "cannot resolve TARGET"),
        (["inspect", "no_such_package_xyz:factory"], "cannot import"),
    ],
)
def test_errors_exit_1_without_traceback(argv, message, capsys):
    code, _, err = run(capsys, *argv)
    assert code == 1
    assert message in err
    assert "Traceback" not in err


def test_debug_shows_the_traceback():
    with pytest.raises(cli.TargetError, match="unknown zoo model"):
        cli.main(["inspect", "models_zoo:no_such_model", "--debug"])


# -- zoo, bench, module entry ---------------------------------------------------------------------


def test_zoo_lists_the_models(capsys):
    from models_zoo import names

    code, out, _ = run(capsys, "zoo")
    assert code == 0
    for name in names():
        assert name in out
    assert "request:" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["dlrm", "din", "--quick", "--no-inductor"],
        # options before the models, as in the benchmark's own usage
        ["--candidates", "1024", "--no-inductor", "--threads", "1", "--max-repeats", "10",
         "--models", "dlrm"],
    ],
)  # fmt: skip
def test_bench_runs_the_benchmark_script(argv, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cli_bench.subprocess, "call", lambda command: calls.append(command) or 0)
    code, _, _ = run(capsys, "bench", *argv)
    assert code == 0
    (command,) = calls
    assert command[1].endswith("benchmarks/speed.py")
    assert command[2:] == argv


def test_bench_help_lists_the_benchmark_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rocs bench")
    for option in ("--candidates", "--requests", "--no-inductor", "--threads", "--quick"):
        assert option in out
    assert "candidates per request" in out


def test_bench_argument_errors_name_the_argument(monkeypatch, capsys):
    monkeypatch.setattr(cli_bench.subprocess, "call", lambda command: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--candidates", "many"])
    assert exit_info.value.code == 2
    error, hint = capsys.readouterr().err.splitlines()
    assert error == "rocs bench: error: argument --candidates: invalid int value: 'many'"
    assert "--help" in hint


def test_bench_without_the_script_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(cli_bench, "bench_script", lambda: None)
    code, _, err = run(capsys, "bench")
    assert code == 1 and "benchmarks/speed.py" in err


def test_python_dash_m_entry():
    proc = subprocess.run(
        [sys.executable, "-m", "rocs_compiler.cli", "zoo"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dlrm" in proc.stdout


def test_inspect_counts_flops_at_the_history_lengths_it_is_given(capsys):
    """``--length NAMES=L,...`` marks the named histories dynamic in the example and counts
    FLOPs per request and per candidate at each length; DIN's grow linearly with it."""
    code, out, _ = run(
        capsys, "inspect", "models_zoo:din", "--length", "hist_item_ids+hist_cat_ids=10,20,40",
        "--candidates", "64", "--format", "json",
    )  # fmt: skip
    assert code == 0
    data = json.loads(out)
    rows = {row["length"]: row for row in data["by_length"]}
    assert set(rows) == {10, 20, 40} and data["lengths"] == {"hist_item_ids": 10}
    for side in ("request_flops", "candidate_flops"):
        step = rows[20][side] - rows[10][side]
        assert step > 0 and rows[40][side] - rows[20][side] == pytest.approx(2 * step)
    assert data["jagged"].startswith("on:")
    code, out, _ = run(capsys, "inspect", "models_zoo:din", "--length", "hist_item_ids+hist_cat_ids=10,2048")
    assert code == 0 and "by history length  : hist_item_ids" in out
    assert "2048" in out.split("by history length")[1]


def test_inspect_counts_the_mean_flops_over_a_distribution_of_history_lengths(capsys):
    """``--length-distribution NAMES=L*K,...``: one length per request (``L*K``: K requests at
    L); FLOPs per request and per candidate are the mean over them."""
    at = {}
    for spec in ("30", "2048", "30*63,2048"):
        option = "--length-distribution" if "*" in spec else "--length"
        code, out, _ = run(
            capsys, "inspect", "models_zoo:din", option, f"hist_item_ids+hist_cat_ids={spec}",
            "--candidates", "8", "--requests", "64", "--format", "json",
        )  # fmt: skip
        assert code == 0
        at[spec] = json.loads(out)
    mixed = at["30*63,2048"]
    assert mixed["lengths"] == {"hist_item_ids": [30] * 63 + [2048]}
    for side in ("request_flops", "candidate_flops"):
        want = (63 * at["30"]["totals"][side] + at["2048"]["totals"][side]) / 64
        assert mixed["totals"][side] == pytest.approx(want)
    code, out, _ = run(
        capsys, "inspect", "models_zoo:din", "--length-distribution", "hist_item_ids+hist_cat_ids=5*3,7"
    )
    assert code == 0 and "hist_item_ids=mean 5.5 over 4 requests (max 7)" in out
    with pytest.raises(SystemExit):
        cli.main(["inspect", "models_zoo:din", "--length-distribution", "hist_item_ids=5*x"])


def test_inspect_refuses_a_length_for_an_input_without_one(capsys):
    code, _, err = run(capsys, "inspect", "models_zoo:din", "--length", "item_id=10")
    assert code == 1 and "--length-distribution names 'item_id'" in err and "hist_item_ids" in err
    with pytest.raises(SystemExit):
        cli.main(["inspect", "models_zoo:din", "--length", "hist_item_ids"])
