"""Elementwise programs for ``rocs::broadcast_pointwise``: parser, torch evaluator, Triton source.

A program is a small expression over candidate inputs ``c0, c1, ...`` ([N, *S]), request
inputs ``r0, r1, ...`` ([R, *S], read at row ``candidate_to_request[n]``) and float
literals, for example ``"mul(sigmoid(add(c0, r0)), r1)"``. Its canonical text
(``format_program(parse_program(text))``: ``op(a, b)`` with ``", "`` separators and literals
as Python float reprs) is the program's identity in caches and op arguments.

Ops (one table, ``PRIMITIVES``; each entry gives the torch form and the Triton form):
add sub mul div neg relu sigmoid tanh silu gelu (erf form) exp log abs sqrt rsqrt maximum
minimum, and ``where(cond, a, b)``, which selects ``a`` where ``cond != 0``.

The Triton source of a program comes from one template (``kernel_source``): load every
used candidate input at ``offs``, every used request input at
``idx[offs // inner] * inner + offs % inner``, apply the chain in float32 (one line per
distinct subexpression), store in the output dtype. Nothing here imports triton; compiling
the text is ``pointwise_triton.py``'s job.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class ProgramError(ValueError):
    """A program string that does not parse or does not fit its inputs."""


# ---------------------------------------------------------------------------------------
# AST
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Input:
    kind: str  # "c" (candidate, [N, *S]) or "r" (request, [R, *S])
    index: int

    def __str__(self) -> str:
        return f"{self.kind}{self.index}"


@dataclass(frozen=True)
class Const:
    value: float

    def __str__(self) -> str:
        return repr(float(self.value))


@dataclass(frozen=True)
class Call:
    op: str
    args: tuple

    def __str__(self) -> str:
        return f"{self.op}({', '.join(str(a) for a in self.args)})"


Node = Input | Const | Call


@dataclass(frozen=True)
class Primitive:
    arity: int
    # Eager form, as the unfused graph computes it (operators accept Python floats).
    torch_fn: Callable
    # Same computation written into a preallocated ``out=`` tensor (tensor arguments only).
    torch_out: Callable
    # Triton expression; {0}, {1}, {2} are argument names (or literals), evaluated in float32.
    triton: str
    # The ATen overload the primitive computes, which ikbo fuses into programs (None: the
    # primitive has no ATen spelling that a graph would carry with these operands).
    aten: object = None


def as_tensor_arg(x, like):
    """Float literal -> 0-dim tensor of ``like``'s dtype, for functions that take tensors only."""
    if isinstance(x, torch.Tensor):
        return x
    return torch.tensor(x, dtype=like.dtype, device=like.device) if like is not None else x


def _where(c, a, b, out=None):
    return torch.where(c != 0, a, b, out=out) if out is not None else torch.where(c != 0, a, b)


_MAX = "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)"
_MIN = "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)"
_GELU = "0.5 * {0} * (1.0 + tl.erf({0} * 0.7071067811865476))"
_aten = torch.ops.aten

PRIMITIVES: dict[str, Primitive] = {
    "add": Primitive(2, lambda a, b: a + b, torch.add, "{0} + {1}", _aten.add.Tensor),
    "sub": Primitive(2, lambda a, b: a - b, torch.sub, "{0} - {1}", _aten.sub.Tensor),
    "mul": Primitive(2, lambda a, b: a * b, torch.mul, "{0} * {1}", _aten.mul.Tensor),
    "div": Primitive(2, lambda a, b: a / b, torch.div, "{0} / {1}", _aten.div.Tensor),
    "neg": Primitive(1, lambda a: -a, torch.neg, "-{0}", _aten.neg.default),
    # relu(nan) is nan in torch (as in clamp_min): compare with < so NaN falls through.
    "relu": Primitive(
        1,
        torch.relu,
        lambda a, out: torch.clamp_min(a, 0, out=out),
        "tl.where({0} < 0.0, 0.0, {0})",
        _aten.relu.default,
    ),
    "sigmoid": Primitive(1, torch.sigmoid, torch.sigmoid, "tl.sigmoid({0})", _aten.sigmoid.default),
    "tanh": Primitive(1, torch.tanh, torch.tanh, "_tanh({0})", _aten.tanh.default),
    "silu": Primitive(1, F.silu, _aten.silu.out, "{0} * tl.sigmoid({0})", _aten.silu.default),
    "gelu": Primitive(1, F.gelu, _aten.gelu.out, _GELU, _aten.gelu.default),
    "exp": Primitive(1, torch.exp, torch.exp, "tl.exp({0})", _aten.exp.default),
    "log": Primitive(1, torch.log, torch.log, "tl.log({0})", _aten.log.default),
    "abs": Primitive(1, torch.abs, torch.abs, "tl.abs({0})", _aten.abs.default),
    "sqrt": Primitive(1, torch.sqrt, torch.sqrt, "tl.sqrt_rn({0})", _aten.sqrt.default),
    "rsqrt": Primitive(1, torch.rsqrt, torch.rsqrt, "tl.rsqrt({0})", _aten.rsqrt.default),
    "maximum": Primitive(2, torch.maximum, torch.maximum, _MAX, _aten.maximum.default),
    "minimum": Primitive(2, torch.minimum, torch.minimum, _MIN, _aten.minimum.default),
    "where": Primitive(3, _where, _where, "tl.where({0} != 0.0, {1}, {2})"),
}

# Ops whose torch form needs tensor arguments (operators accept Python floats).
_TENSOR_ONLY = {name for name in PRIMITIVES if name not in ("add", "sub", "mul", "div", "neg")}

# Jitted helpers the generated source imports from ``triton_math`` when a program uses them.
_TRITON_HELPERS = {"tanh": "_tanh"}


# ---------------------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"\s*(?:(?P<num>[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)"
    r"|(?P<name>[A-Za-z_][A-Za-z_0-9]*)|(?P<punct>[(),]))"
)
_INPUT = re.compile(r"([cr])(\d+)")


def _tokenize(text: str) -> list[tuple[str, str, int]]:
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            raise ProgramError(f"unexpected character at {pos}: {text[pos : pos + 10]!r}")
        kind = match.lastgroup
        tokens.append((kind, match.group(kind), match.start(kind)))
        pos = match.end()
    return tokens


@functools.lru_cache(maxsize=1024)
def parse_program(text: str) -> Node:
    """Parse a program string into its AST; raises ``ProgramError`` with a position."""
    tokens = _tokenize(text)
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else ("end", "", len(text))

    def take(kind, value=None):
        nonlocal pos
        tok = peek()
        if tok[0] != kind or (value is not None and tok[1] != value):
            want = value if value is not None else kind
            raise ProgramError(f"expected {want!r} at {tok[2]}, got {tok[1] or 'end'!r}")
        pos += 1
        return tok

    def expr() -> Node:
        kind, value, at = peek()
        if kind == "num":
            take("num")
            return Const(float(value))
        name = take("name")[1]
        match = _INPUT.fullmatch(name)
        if match:
            return Input(match.group(1), int(match.group(2)))
        if name not in PRIMITIVES:
            raise ProgramError(f"unknown op {name!r} at {at}")
        take("punct", "(")
        args = [expr()]
        while peek()[1] == ",":
            take("punct", ",")
            args.append(expr())
        take("punct", ")")
        if len(args) != PRIMITIVES[name].arity:
            raise ProgramError(
                f"{name} takes {PRIMITIVES[name].arity} arguments, got {len(args)} (at {at})"
            )
        return Call(name, tuple(args))

    node = expr()
    if pos != len(tokens):
        raise ProgramError(f"trailing input at {tokens[pos][2]}: {tokens[pos][1]!r}")
    return node


def as_program(program: str | Node) -> Node:
    return parse_program(program) if isinstance(program, str) else program


def format_program(program: str | Node) -> str:
    """Canonical text of a program."""
    return str(as_program(program))


def rename_inputs(program: str | Node, names: Callable[[Input], Node]) -> Node:
    """The program with every input ``x`` replaced by ``names(x)`` (an input or a subprogram)."""
    node = as_program(program)
    if isinstance(node, Input):
        return names(node)
    if isinstance(node, Call):
        return Call(node.op, tuple(rename_inputs(a, names) for a in node.args))
    return node


def walk(node: Node):
    """Post-order traversal (arguments before the call)."""
    if isinstance(node, Call):
        for arg in node.args:
            yield from walk(arg)
    yield node


def used_inputs(program: str | Node) -> tuple[set[int], set[int]]:
    """Indices of the candidate and request inputs a program reads."""
    inputs = [n for n in walk(as_program(program)) if isinstance(n, Input)]
    return {n.index for n in inputs if n.kind == "c"}, {n.index for n in inputs if n.kind == "r"}


def num_ops(program: str | Node) -> int:
    """Distinct op applications (after common-subexpression sharing), for FLOP counts."""
    return len({str(n) for n in walk(as_program(program)) if isinstance(n, Call)})


def check_program(program: str | Node, num_candidate: int, num_request: int) -> Node:
    node = as_program(program)
    cand, req = used_inputs(node)
    if cand and max(cand) >= num_candidate:
        raise ProgramError(f"program reads c{max(cand)} but has {num_candidate} candidate inputs")
    if req and max(req) >= num_request:
        raise ProgramError(f"program reads r{max(req)} but has {num_request} request inputs")
    if num_candidate + num_request == 0:
        raise ProgramError("broadcast_pointwise needs at least one input tensor")
    return node


# ---------------------------------------------------------------------------------------
# Torch evaluator
# ---------------------------------------------------------------------------------------


def evaluate(
    program: str | Node, env: dict[str, torch.Tensor], like: torch.Tensor | None = None
) -> torch.Tensor | float:
    """Evaluate with torch ops on row-aligned tensors ``env = {"c0": ..., "r0": ...}``.

    Every op runs in the inputs' dtype, exactly as the unfused eager chain would. Shared
    subexpressions are evaluated once. Literals become tensors of ``like``'s dtype and
    device (default: any tensor of ``env``) where an op needs tensors. The result of a
    program that reads no input is a 0-dim tensor or a float; callers broadcast it.
    """
    if like is None:
        like = next(iter(env.values()), None)
    root = as_program(program)
    # Iterative, with each temporary dropped after its last use, so a chain holds only
    # its live values (a recursive closure would also keep them alive in a reference cycle).
    uses: dict[str, int] = {}
    for node in distinct_subexpressions(root):
        if isinstance(node, Call):
            for arg in node.args:
                uses[str(arg)] = uses.get(str(arg), 0) + 1
    values: dict[str, object] = {}
    for node in distinct_subexpressions(root):
        key = str(node)
        if isinstance(node, Input):
            values[key] = env[key]
        elif isinstance(node, Const):
            values[key] = node.value
        else:
            args = [values[str(a)] for a in node.args]
            if node.op in _TENSOR_ONLY or all(not isinstance(a, torch.Tensor) for a in args):
                args = [as_tensor_arg(a, like) for a in args]
            values[key] = PRIMITIVES[node.op].torch_fn(*args)
            for arg in node.args:
                arg_key = str(arg)
                uses[arg_key] -= 1
                if uses[arg_key] == 0:
                    del values[arg_key]
    return values[str(root)]


def distinct_subexpressions(root: Node):
    """Post-order traversal that yields each distinct subexpression once."""
    seen = set()
    for node in walk(root):
        key = str(node)
        if key not in seen:
            seen.add(key)
            yield node


# ---------------------------------------------------------------------------------------
# Triton source generator
# ---------------------------------------------------------------------------------------

KERNEL_NAME = "rocs_pointwise_kernel"

_TEMPLATE = '''\
"""Generated by rocs_compiler.kernels.pointwise_program; do not edit.

program: {program}
inputs: {num_candidate} candidate [N, *S] at offs, {num_request} request [R, *S] at
candidate_to_request[offs // inner] (inner = prod(S)); math in float32.
"""

import triton
import triton.language as tl
{helper_imports}

@triton.jit
def {kernel_name}(
    out_ptr, idx_ptr,{input_ptrs}
    numel, inner,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
{body}
    tl.store(out_ptr + offs, {result}.to(out_ptr.dtype.element_ty), mask=mask)
'''


def kernel_source(program: str | Node, num_candidate_inputs: int, num_request_inputs: int) -> str:
    """Triton source of the broadcast pointwise kernel for ``program`` (deterministic text)."""
    node = check_program(program, num_candidate_inputs, num_request_inputs)
    cand, req = used_inputs(node)
    body: list[str] = []
    if req:
        body.append(
            "offs_req = tl.load(idx_ptr + offs // inner, mask=mask, other=0) * inner + offs % inner"
        )
    for i in sorted(cand):
        body.append(f"c{i} = tl.load(c{i}_ptr + offs, mask=mask, other=0.0).to(tl.float32)")
    for i in sorted(req):
        body.append(f"r{i} = tl.load(r{i}_ptr + offs_req, mask=mask, other=0.0).to(tl.float32)")

    names: dict[str, str] = {}
    helpers: set[str] = set()
    num_temps = 0

    def name_of(n: Node, position: int) -> str:
        if isinstance(n, Const):
            # A literal in first position is made a block, so that calls on constants
            # (``sigmoid(1.0)``, ``sub(1.0, c0)``) are tensor expressions.
            if position == 0:
                return f"tl.full((BLOCK,), {n}, tl.float32)"
            return str(n)
        return names[str(n)]

    for n in walk(node):
        key = str(n)
        if key in names:
            continue
        if isinstance(n, Input):
            names[key] = key
        elif isinstance(n, Call):
            if n.op in _TRITON_HELPERS:
                helpers.add(_TRITON_HELPERS[n.op])
            args = [name_of(a, i) for i, a in enumerate(n.args)]
            temp = f"t{num_temps}"
            num_temps += 1
            body.append(f"{temp} = {PRIMITIVES[n.op].triton.format(*args)}")
            names[key] = temp
    result = name_of(node, 0)

    input_ptrs = [f"c{i}_ptr" for i in range(num_candidate_inputs)]
    input_ptrs += [f"r{i}_ptr" for i in range(num_request_inputs)]
    helper_imports = "".join(
        f"\nfrom rocs_compiler.kernels.triton_math import {h.lstrip('_')} as {h}\n"
        for h in sorted(helpers)
    )
    return _TEMPLATE.format(
        program=format_program(node),
        num_candidate=num_candidate_inputs,
        num_request=num_request_inputs,
        helper_imports=helper_imports,
        kernel_name=KERNEL_NAME,
        input_ptrs="".join(f" {p}," for p in input_ptrs),
        body="\n".join("    " + line for line in body),
        result=result,
    )
