"""Property-based differential tests on generated models.

Hypothesis draws a small straight-line program over three inputs, ``u1`` (request, float
[B, D]), ``u2`` (request, int ids [B]) and ``c1`` (candidate, float [B, D]), mixing row-wise ops
with ops that mix rows of the batch (softmax/mean/cumsum over dim 0, ``x * x.size(0)``) and with the shapes the defer pass rewrites
(request/candidate concatenations and stacks feeding linear maps, norms, softmaxes, slices,
reductions, linear compression and bmm), with ops that move the batch away from dim 0 or merge
it with other dims (transposes, stacks in front, reshapes through ``[B*D]``, a GRU over a
two-step sequence in either layout) and with in-place updates through views. A
module interprets the program; it is compiled with rocs and compared with the eager module on
ragged batches in both calling conventions. The oracle knows nothing about roles or passes.

``ROCS_HYPOTHESIS_EXAMPLES`` sets the number of examples (200 by default, 60 with ``CI`` set);
with ``CI`` set the draws are derandomized so that a run is reproducible.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from models_for_tests import OPTION_IDS, OPTION_SETS, OPTIONS, assert_outputs_match, eager
from torch import nn

import rocs_compiler as rocs
from models_zoo import Batch, request_index

D = 4  # feature width; even, for the [B, D] -> [B, 2, D/2] view
VOCAB = 11
WIDE, NARROW = D, 1  # value widths: [B, D] or [B, 1]


@dataclass(frozen=True)
class Op:
    """One step: ``values.append(kind(values[a], values[b]))``; ``variant`` picks a flavour."""

    kind: str
    a: int = -1
    b: int = -1
    variant: int = 0


# kind -> (operands, operand widths allowed, output width rule)
#   operands: how many earlier values it reads
#   wide_only: operands must be [B, D]
#   out: "wide", "narrow", "same" (width of a), "max" (width of the broadcast)
OPS = {
    "linear": (1, True, "wide"),
    "act": (1, False, "same"),
    "add": (2, False, "max"),
    "mul": (2, False, "max"),
    "cat_linear": (2, False, "wide"),
    "cat_slice": (2, True, "wide"),
    "glm_linear": (2, False, "wide"),
    "layer_norm": (1, True, "wide"),
    "embed": (0, False, "wide"),
    "softmax_dim1": (1, True, "wide"),
    "softmax_dim0": (1, False, "same"),
    "mean_dim0_add": (2, False, "max"),
    "cumsum_dim0": (1, False, "same"),
    "times_batch_size": (1, False, "same"),
    "view_round_trip": (1, True, "wide"),
    "stack_bmm": (2, True, "wide"),
    "stack_reduce": (2, True, "wide"),
    "compress": (2, True, "wide"),
    "sum_dim1": (1, True, "narrow"),
    "matmul_weight": (1, True, "wide"),
    "move_batch": (1, True, "wide"),
    "write_through_view": (2, True, "wide"),
    "gru": (2, True, "wide"),
}
ACTIVATIONS = (torch.relu, torch.sigmoid, torch.tanh)


@st.composite
def programs(draw) -> tuple[tuple[Op, ...], tuple[int, ...]]:
    widths = [WIDE, WIDE]  # values[0] = u1, values[1] = c1; ids u2 are read by "embed" only
    ops = []
    for _ in range(draw(st.integers(4, 10))):
        kind = draw(st.sampled_from(sorted(OPS)))
        arity, wide_only, out = OPS[kind]
        allowed = [i for i, w in enumerate(widths) if w == WIDE or not wide_only]
        a = draw(st.sampled_from(allowed)) if arity >= 1 else -1
        b = draw(st.sampled_from(allowed)) if arity >= 2 else -1
        variant = draw(st.integers(0, 3))
        ops.append(Op(kind, a, b, variant))
        if out == "wide":
            widths.append(WIDE)
        elif out == "narrow":
            widths.append(NARROW)
        elif out == "same":
            widths.append(widths[a])
        else:
            widths.append(max(widths[a], widths[b]))
    last = len(widths) - 1
    extra = draw(st.lists(st.integers(0, last), max_size=1))
    return tuple(ops), (last, *extra)


class Program(nn.Module):
    """Interprets a drawn program; parameters are created per step."""

    def __init__(self, ops: tuple[Op, ...], outputs: tuple[int, ...]):
        super().__init__()
        self.ops, self.outputs = ops, outputs
        widths = [WIDE, WIDE]
        self.layers = nn.ModuleList()
        for op in ops:
            wa = widths[op.a] if op.a >= 0 else 0
            wb = widths[op.b] if op.b >= 0 else 0
            layer: nn.Module = nn.Identity()
            if op.kind == "linear":
                layer = nn.Linear(D, D)
            elif op.kind == "cat_linear":
                layer = nn.Linear(wa + wb, D)
            elif op.kind == "glm_linear":
                # Generalized layer masking: the first D/2 outputs never see ``b``'s columns.
                layer = nn.Linear(wa + wb, D)
                with torch.no_grad():
                    layer.weight[: D // 2, wa:] = 0
                    if op.variant % 2:
                        layer.weight[0, wa] = 0.5  # one non-zero entry: not a masked block
            elif op.kind == "layer_norm":
                layer = nn.LayerNorm(D)
                with torch.no_grad():
                    layer.weight.uniform_(0.5, 1.5)
                    layer.bias.uniform_(-0.5, 0.5)
            elif op.kind == "embed":
                layer = nn.Embedding(VOCAB, D)
            elif op.kind == "stack_bmm":
                layer = nn.Linear(4, D)
            elif op.kind == "stack_reduce":
                layer = nn.Linear(D, D, bias=False)  # weight used by torch.matmul
            elif op.kind == "compress":
                layer = nn.Linear(3, 2, bias=False)  # weight [2, 3] mixes the stacked features
            elif op.kind == "matmul_weight":
                layer = nn.Linear(D, D, bias=False)  # its weight is used with torch.matmul
            elif op.kind == "move_batch":
                layer = nn.Linear(D, D)
            elif op.kind == "gru":
                layer = nn.GRU(D, D, batch_first=bool(op.variant % 2))
            self.layers.append(layer)
            _, _, out = OPS[op.kind]
            widths.append({"wide": WIDE, "narrow": NARROW, "same": wa, "max": max(wa, wb)}[out])

    def forward(self, u1, u2, c1):
        values = [u1, c1]
        for op, layer in zip(self.ops, self.layers):
            a = values[op.a] if op.a >= 0 else None
            b = values[op.b] if op.b >= 0 else None
            values.append(self.step(op, layer, a, b, u2))
        return tuple(values[i] for i in self.outputs)

    @staticmethod
    def step(op: Op, layer, a, b, ids):
        k, v = op.kind, op.variant
        if k == "linear":
            return layer(a)
        if k == "act":
            return ACTIVATIONS[v % len(ACTIVATIONS)](a)
        if k == "add":
            return a + b
        if k == "mul":
            return a * b
        if k == "cat_linear":
            # Where request and candidate features meet: the defer pass splits or distributes
            # these; layer_norm and softmax over the concatenated axis must not be distributed.
            x = torch.cat([a, b], dim=1)
            if v == 1:
                x = torch.relu(x)
            elif v == 2:
                x = F.layer_norm(x, x.shape[-1:])
            elif v == 3:
                x = torch.softmax(x, dim=1)
            return layer(x)
        if k == "glm_linear":
            out = layer(torch.cat([a, b], dim=1))
            return torch.relu(out) if v >= 2 else out
        if k == "cat_slice":
            return torch.cat([a, b], dim=1)[:, 1 : 1 + D]  # crosses the boundary of a and b
        if k == "layer_norm":
            return layer(a)
        if k == "embed":
            return layer(ids)
        if k == "softmax_dim1":
            return torch.softmax(a, dim=1)
        if k == "softmax_dim0":
            return torch.softmax(a, dim=0)
        if k == "mean_dim0_add":
            return a.mean(0, keepdim=True) + b
        if k == "cumsum_dim0":
            return torch.cumsum(a, dim=0)
        if k == "times_batch_size":
            return a * a.size(0) if v else a / a.size(0)
        if k == "view_round_trip":
            if v == 0:
                return a.view(a.size(0), 2, D // 2).reshape(a.size(0), D)
            if v == 1:
                return a.reshape(-1, 2, D // 2).transpose(1, 2).reshape(-1, D)
            if v == 2:
                return a.unsqueeze(1).flatten(1)
            return a.reshape(a.size(0) * 2, D // 2).reshape(-1, D)  # through [2B, D/2]
        if k == "stack_bmm":
            s = torch.stack([a, b], dim=1)  # [B, 2, D]
            return layer(torch.bmm(s, s.transpose(1, 2)).flatten(1))  # [B, 4] -> [B, D]
        if k == "stack_reduce":
            s = torch.stack([a, b], dim=1)  # [B, 2, D]
            if v == 0:
                return s.sum(1)
            if v == 1:
                return torch.softmax(s, dim=1)[:, 0]
            if v == 2:
                return s.unbind(1)[1] * 2
            return torch.matmul(s, layer.weight).amax(1)
        if k == "compress":
            s = torch.stack([a, b, a * b], dim=1)  # [B, 3, D]
            if v % 2:
                out = torch.einsum("bfd,gf->bgd", s, layer.weight)
            else:
                out = torch.matmul(layer.weight, s)  # [2, 3] @ [B, 3, D] -> [B, 2, D]
            return out.sum(1)
        if k == "sum_dim1":
            return a.sum(dim=1, keepdim=True)
        if k == "matmul_weight":
            return torch.matmul(a, layer.weight)
        if k == "move_batch":
            if v == 0:
                return (a.t() * layer.weight[:, :1]).t()  # row-wise along dim 1 of [D, B]
            if v == 1:
                return layer(torch.stack([a, a.relu()], 0)).mean(0)  # [2, B, D]
            if v == 2:
                return (a.reshape(-1) * 2).reshape(-1, 2).flip(1).reshape(a.size(0), D)
            return a.t().reshape(-1).view(a.size(0), D)  # mixes rows: [D, B] -> [B, D]
        if k == "write_through_view":
            x = a.clone()
            if v == 0:
                x[:, 0] = 0.0
            elif v == 1:
                x[:, :2].mul_(b[:, :2])
            elif v == 2:
                x += b
                x.masked_fill_(x > 1.0, 0.0)
            else:
                x.t()[0].add_(b[:, 0])  # column 0 through a transposed view
            return x
        if k == "gru":
            seq = torch.stack([a, b], 1 if layer.batch_first else 0)
            out, last = layer(seq)
            out = out.mean(1 if layer.batch_first else 0)
            return out + last[-1] if v >= 2 else out
        raise AssertionError(k)


def source(ops: tuple[Op, ...], outputs: tuple[int, ...]) -> str:
    """A readable listing of a program, for failure reports."""
    lines = ["v0 = u1 (request)", "v1 = c1 (candidate)"]
    for i, op in enumerate(ops, start=2):
        args = ", ".join(f"v{x}" for x in (op.a, op.b) if x >= 0) or "u2"
        lines.append(f"v{i} = {op.kind}[{op.variant}]({args})")
    lines.append("return " + ", ".join(f"v{i}" for i in outputs))
    return "\n".join(lines)


def make_batch(counts, seed: int, shuffle: bool) -> Batch:
    g = torch.Generator().manual_seed(seed)
    R, N = len(counts), sum(counts)
    kwargs = {
        "u1": torch.randn(R, D, generator=g),
        "u2": torch.randint(0, VOCAB, (R,), generator=g),
        "c1": torch.randn(N, D, generator=g),
    }
    return Batch(kwargs, request_index(counts, shuffle=shuffle, generator=g), ("u1", "u2"))


# CI runs fewer (derandomized, so the same ones every run) to keep the whole run in its budget.
EXAMPLES = int(os.environ.get("ROCS_HYPOTHESIS_EXAMPLES", "40" if os.environ.get("CI") else "200"))
# The generated pointwise kernels are on by default only for models on a GPU; draw them on CPU
# too, through their CPU implementation.
RANDOM_OPTION_SETS = OPTION_SETS + ([{"ikbo_pointwise": True}] if "ikbo" not in OPTIONS else [])
RANDOM_OPTION_IDS = OPTION_IDS + ["ikbo-pointwise"][: len(RANDOM_OPTION_SETS) - len(OPTION_SETS)]
ragged_counts = st.lists(st.integers(1, 4), min_size=1, max_size=4)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    program=programs(),
    counts=ragged_counts,
    seed=st.integers(0, 2**16),
    option_index=st.sampled_from(range(len(RANDOM_OPTION_SETS))),
)
def test_random_program_compiles_exactly(program, counts, seed, option_index):
    # The option set is drawn rather than parametrized: one budget of examples covers the
    # default pipeline, the pipeline with the optional passes off, and the pointwise kernels.
    ops, outputs = program
    options = RANDOM_OPTION_SETS[option_index]
    note(f"options: {RANDOM_OPTION_IDS[option_index]}\n" + source(ops, outputs))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Program(ops, outputs).eval()
    example = make_batch([2, 1], seed=seed + 1, shuffle=False).replicated()
    cm = rocs.compile(model, ["u1", "u2"], example_kwargs=example, options=options)
    batches = {
        "R=1 N=1": make_batch([1], seed=seed + 2, shuffle=False),
        "R=1 N=3": make_batch([3], seed=seed + 3, shuffle=False),
        "ragged": make_batch([*counts, 1], seed=seed + 4, shuffle=True),
    }
    for what, batch in batches.items():
        expected = eager(model, batch.replicated())
        shared = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
        assert_outputs_match(shared, expected, f"{what} shared layout")
        assert_outputs_match(cm(**batch.replicated()), expected, f"{what} drop-in")
