"""The demo's output: a speed table whose columns line up whatever the model names, and reports
whose module column names a real module or ``-``."""

from __future__ import annotations

import re

import rocs_compiler as rocs
from models_zoo import ZOO
from rocs_compiler.demo import speed_table


def test_speed_table_columns_line_up_with_long_model_names():
    rows = [
        ("target_attention", 12.3456, 1.2, 1.5, 38.4, True),
        ("dlrm", 3.07, 2.19, 102.41, 1.51, False),
    ]
    header, *lines = speed_table(rows)
    assert len(lines) == 2
    ends = [m.end() for m in re.finditer(r"\S+( ms)?", header)]  # each column's right edge
    for line in lines:
        cells = list(re.finditer(r"\S+", line))
        assert len(cells) == len(ends), line
        assert line.startswith(cells[0].group()) and cells[0].start() == 0
        for cell, end in zip(cells[1:-1], ends[1:-1]):  # numbers: right-aligned under headers
            assert cell.end() == end, (line, header)
        assert cells[-1].start() == header.index("exact"), (line, header)


def test_report_module_column_names_a_module_or_a_dash():
    entry = ZOO["target_attention"]
    compiled = rocs.compile(
        entry.build(0), entry.request_inputs, example_kwargs=entry.make_batch([4, 3]).replicated(),
        options={"autotune": False},
    )  # fmt: skip
    text = compiled.report(candidates=64).to_text()
    assert "_empty_nn_module_stack" not in text
    table = text.split("\n\n")[0].splitlines()[2:]
    rows = [line for line in table if not line.startswith(("...", "(*"))]
    modules = [line[92:].removesuffix(" *").strip() for line in rows]
    assert all(modules), "every row names a module or shows '-'"
    assert "-" in modules and any(m != "-" for m in modules)
