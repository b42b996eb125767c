"""Pointwise programs: parser, canonical text, evaluator, generated Triton source.

Golden snapshots: the generated source for a few representative programs is pinned in
``tests/kernels/golden/``. After an intended change to the template, regenerate them with

    ROCS_UPDATE_GOLDEN=1 python -m pytest tests/kernels/test_pointwise_program.py

and review the diff.
"""

from __future__ import annotations

import ast
import os
import pathlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rocs_compiler.kernels.pointwise_program import (
    PRIMITIVES,
    Call,
    Const,
    Input,
    ProgramError,
    evaluate,
    format_program,
    kernel_source,
    num_ops,
    parse_program,
    used_inputs,
)

GOLDEN_DIR = pathlib.Path(__file__).parent / "golden"

GOLDEN_PROGRAMS = {
    # name: (program, #candidate inputs, #request inputs)
    "gate": ("mul(sigmoid(add(c0, r0)), r1)", 1, 2),
    "activations": ("add(tanh(c0), gelu(silu(r0)))", 1, 1),
    "select": ("where(relu(sub(c0, 0.25)), maximum(r0, c1), minimum(neg(r1), -0.5))", 2, 2),
    "shared_subexpr_no_request": (
        "div(add(c0, 1.0), sqrt(add(mul(add(c0, 1.0), add(c0, 1.0)), 1e-05)))",
        1,
        0,
    ),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_PROGRAMS))
def test_golden_kernel_source(name):
    program, num_c, num_r = GOLDEN_PROGRAMS[name]
    source = kernel_source(program, num_c, num_r)
    path = GOLDEN_DIR / f"pointwise_{name}.py.txt"
    if os.environ.get("ROCS_UPDATE_GOLDEN") == "1":
        path.write_text(source)
    assert path.exists(), f"missing golden file {path}; run with ROCS_UPDATE_GOLDEN=1"
    assert source == path.read_text(), (
        f"generated source for {name!r} changed; see module docstring"
    )


def test_parse_and_canonical_text():
    node = parse_program("  mul( sigmoid(add(c0,r0)) ,r1 ) ")
    assert node == Call(
        "mul", (Call("sigmoid", (Call("add", (Input("c", 0), Input("r", 0))),)), Input("r", 1))
    )
    assert format_program(node) == "mul(sigmoid(add(c0, r0)), r1)"
    assert format_program("add(c0, -1)") == "add(c0, -1.0)"
    assert parse_program("add(c0, 2.5e-3)").args[1] == Const(0.0025)
    assert used_inputs("where(c2, r0, add(c2, 1.0))") == ({2}, {0})


@pytest.mark.parametrize(
    "text, message",
    [
        ("add(c0)", "takes 2"),
        ("foo(c0)", "unknown op"),
        ("add(c0, r0", r"expected '\)'"),
        ("add(c0, r0) c1", "trailing"),
        ("add(c0, $)", "unexpected character"),
        ("", "expected 'name'"),
    ],
)
def test_parse_errors(text, message):
    with pytest.raises(ProgramError, match=message):
        parse_program(text)


def test_input_counts_are_checked():
    with pytest.raises(ProgramError, match="c1"):
        kernel_source("add(c1, r0)", 1, 1)
    with pytest.raises(ProgramError, match="r0"):
        kernel_source("add(c0, r0)", 1, 0)


def test_shared_subexpressions_become_one_temp():
    source = kernel_source("mul(exp(c0), exp(c0))", 1, 0)
    assert source.count("tl.exp(") == 1
    assert num_ops("mul(exp(c0), exp(c0))") == 2


def test_unused_inputs_are_not_loaded():
    source = kernel_source("neg(c1)", 2, 1)
    assert "c0_ptr, c1_ptr, r0_ptr" in source  # the signature keeps every input
    assert "tl.load(c0_ptr" not in source and "offs_req" not in source


def test_evaluate_constants_and_dtype():
    x = torch.tensor([1.0, -2.0], dtype=torch.float16)
    out = evaluate("add(c0, sigmoid(0.0))", {"c0": x})
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, x + 0.5)


# Random programs: the generated source must be valid Python and name every input it reads.


def _programs(max_leaves=6):
    leaf = st.one_of(
        st.builds(Input, st.sampled_from(["c", "r"]), st.integers(0, 1)),
        st.builds(Const, st.floats(-3, 3, allow_nan=False).map(lambda v: round(v, 3))),
    )

    def extend(children):
        return st.sampled_from(sorted(PRIMITIVES)).flatmap(
            lambda op: st.tuples(*[children] * PRIMITIVES[op].arity).map(
                lambda args: Call(op, args)
            )
        )

    return st.recursive(leaf, extend, max_leaves=max_leaves)


@settings(max_examples=25, deadline=None)
@given(program=_programs())
def test_random_programs_round_trip_and_generate(program):
    text = format_program(program)
    assert parse_program(text) == program
    source = kernel_source(program, 2, 2)
    ast.parse(source)
    cand, req = used_inputs(program)
    for i in cand:
        assert f"c{i} = tl.load(c{i}_ptr + offs" in source
    for i in req:
        assert f"r{i} = tl.load(r{i}_ptr + offs_req" in source


@settings(max_examples=25, deadline=None)
@given(
    program=_programs(max_leaves=8),
    trailing=st.sampled_from([(), (3,), (2, 5)]),
    chunk_rows=st.sampled_from([1, 3, 1000]),
    seed=st.integers(0, 2**16),
)
def test_random_programs_cpu_op_matches_reference(program, trailing, chunk_rows, seed):
    """The CPU op (chunked, buffer-reusing) against the functional evaluator on gathered rows."""
    from unittest import mock

    import rocs_compiler.kernels as cg
    from rocs_compiler.kernels import pointwise

    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 3, (7,), generator=gen)
    cands = [torch.randn(7, *trailing, generator=gen) for _ in range(2)]
    reqs = [torch.randn(3, *trailing, generator=gen) for _ in range(2)]
    text = format_program(program)
    chunk_bytes = chunk_rows * max(1, int(torch.Size(trailing).numel())) * 4
    with mock.patch.object(pointwise, "CHUNK_BYTES", chunk_bytes):
        out = torch.ops.rocs.broadcast_pointwise(text, cands, reqs, idx)
    ref = cg.ROCS_OPS["broadcast_pointwise"].reference(text, cands, reqs, idx)
    assert out.shape == (7, *trailing)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, equal_nan=True)
