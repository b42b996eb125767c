"""Role soundness by non-interference, on the captured graph and on the graph after the passes.

The oracle does not know any role rule. A node the analysis calls REQUEST claims two things:

1. *Non-interference*: no candidate input reaches it. Re-draw every candidate input (same
   request inputs, same candidate -> request map) and rerun the graph with ``fx.Interpreter``:
   every REQUEST tensor must be bit-identical.
2. *Row-wise*: it commutes with gathering rows (which is what lets the rewrite compute it on R
   rows). Run the graph on a gathered batch ``inputs[g]``: every REQUEST tensor must equal the
   full batch's value gathered by ``g`` (up to re-association: matmuls with another number of
   rows may block their sums differently).

The converse sanity check: some CANDIDATE node does change when the candidates change.
"""

from __future__ import annotations


from typing import Any

import pytest
import torch
from models_for_tests import (
    ALL_OFF,
    HAND_CASES,
    OPTIONS,
    ZOO_NAMES,
    Case,
    Spec,
    copy_structure,
    key,
    mixing_case,
    replace_candidates,
    zoo_pipeline,
)
from torch import fx, nn
from torch.utils import _pytree as pytree

from models_zoo import ZOO, Batch
from models_zoo.history_encoders import (
    Decoder,
    Encoder,
    InPlaceHistory,
    MergedHeads,
    Recurrent,
    SelfAndTargetAttention,
)
from models_zoo.batch import get_leaf, set_leaf
from rocs_compiler.analysis.driver import analyze
from rocs_compiler.analysis.batch_axis import BatchAxis, gather_rows
from rocs_compiler.ir.graph_meta import BATCH_AXIS, ROLE
from rocs_compiler.options import Options
from rocs_compiler.pipeline import compile_graph
from rocs_compiler.ir.roles import Role

COUNTS = [3, 1, 4, 2]  # R = 4, N = 10
GATHER = torch.tensor([7, 0, 0, 9, 3, 3, 3])  # a different number of rows, repeats, any order


class Recorder(fx.Interpreter):
    """Runs a graph and keeps every node's value."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        self.values[n] = out
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _read_tensors(node: fx.Node, value: Any) -> list[tuple[torch.Tensor, BatchAxis]]:
    """The tensors of a REQUEST ``value`` the graph reads, with their batch axes: of a tuple,
    the items some getitem takes (batch norm also returns empty saved statistics that nothing
    reads)."""
    axes = node.meta[BATCH_AXIS]
    if not isinstance(value, (tuple, list)):
        return [(value, axes)]
    return [(v, a) for v, a in zip(value, axes) if a is not None and isinstance(v, torch.Tensor)]


def _run(gm: fx.GraphModule, input_of: dict[str, str], kwargs: dict) -> dict[fx.Node, Any]:
    """Run the graph on replicated ``kwargs``; ``input_of`` maps placeholder -> input name."""
    args = [get_leaf(kwargs, input_of[n.name]) for n in gm.graph.nodes if n.op == "placeholder"]
    recorder = Recorder(gm)
    with torch.no_grad():
        recorder.run(*args)
    return recorder.values


def _analysed(result) -> fx.GraphModule:
    captured = result.captured
    request = {captured.placeholder_of[n] for n in captured.request_inputs}
    analyze(result.logical_graph, request, captured.batch_symbol)
    return result.logical_graph


def _graphs(plain, rewritten) -> list[tuple[str, fx.GraphModule]]:
    """The captured graph (a pipeline with the optional passes off: the passes rewrite the
    captured graph in place) and the graph after the passes, each freshly analysed."""
    out = [("captured", _analysed(plain))]
    if rewritten is not plain:
        out.append(("after passes", _analysed(rewritten)))
    return out


def _gather_batch(kwargs: dict, index: torch.Tensor, names: list[str], batched: dict) -> dict:
    out = copy_structure(kwargs)
    for name in names:
        if batched[name]:
            set_leaf(out, name, get_leaf(kwargs, name).index_select(0, index))
    return out


def check_noninterference(captured, graphs, batch: Batch, other: Batch, what: str) -> None:
    input_of = {p: n for n, p in captured.placeholder_of.items()}
    base = batch.replicated()
    perturbed = replace_candidates(batch, other).replicated()
    for label, gm in graphs:
        ref = _run(gm, input_of, base)
        new = _run(gm, input_of, perturbed)
        leaked, candidate_changed, request_nodes = [], False, 0
        for node, value in ref.items():
            role = node.meta[ROLE]
            if node.op == "output" or not _tensors(value):
                continue
            same = all(torch.equal(a, b) for a, b in zip(_tensors(value), _tensors(new[node])))
            if role == Role.REQUEST:
                request_nodes += 1
                if not same:
                    leaked.append(f"{node.name} ({node.op} {node.target})")
            elif role == Role.CANDIDATE and not same:
                candidate_changed = True
        assert not leaked, (
            f"{what} [{label}]: REQUEST nodes changed when only candidate inputs changed: "
            + ", ".join(leaked)
        )
        assert candidate_changed, f"{what} [{label}]: no CANDIDATE node saw the new candidates"
        assert request_nodes or not captured.request_inputs, f"{what} [{label}]: no REQUEST node"


def check_rowwise(captured, graphs, batch: Batch, what: str) -> None:
    input_of = {p: n for n, p in captured.placeholder_of.items()}
    base = batch.replicated()
    gathered = _gather_batch(base, GATHER, captured.input_names, captured.batched)
    for label, gm in graphs:
        full = _run(gm, input_of, base)
        part = _run(gm, input_of, gathered)
        broken = []
        for node, value in full.items():
            if node.op == "output" or node.meta[ROLE] != Role.REQUEST or not _tensors(value):
                continue
            read = zip(_read_tensors(node, value), _read_tensors(node, part[node]))
            for (a, axis), (b, _) in read:
                expected = gather_rows(a, axis, GATHER)
                if b.shape != expected.shape:
                    broken.append(f"{node.name} (shape {tuple(b.shape)})")
                elif b.is_floating_point():
                    if not torch.allclose(b, expected, rtol=1e-5, atol=1e-5, equal_nan=True):
                        broken.append(f"{node.name} ({node.target})")
                elif not torch.equal(b, expected):
                    broken.append(f"{node.name} ({node.target})")
        assert not broken, (
            f"{what} [{label}]: REQUEST nodes do not commute with gathering rows: "
            + ", ".join(broken)
        )


# ------------------------------------------------------------------------------------------
# Zoo models


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_noninterference(name):
    entry = ZOO[name]
    batch = entry.make_batch(COUNTS, seed=1, shuffle=True)
    other = entry.make_batch(COUNTS, seed=2, shuffle=True)
    plain, rewritten = zoo_pipeline(name, key(ALL_OFF)), zoo_pipeline(name, key(OPTIONS))
    check_noninterference(plain.captured, _graphs(plain, rewritten), batch, other, name)


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_request_nodes_are_rowwise(name):
    entry = ZOO[name]
    batch = entry.make_batch(COUNTS, seed=3, shuffle=True)
    plain, rewritten = zoo_pipeline(name, key(ALL_OFF)), zoo_pipeline(name, key(OPTIONS))
    check_rowwise(plain.captured, _graphs(plain, rewritten), batch, name)


# ------------------------------------------------------------------------------------------
# Hand-written models, including batch-mixing ones whose request-side ops must not be REQUEST

NONINTERFERENCE_CASES: list[Case] = HAND_CASES + [
    mixing_case(name)
    for name in (
        "sum_dim0",
        "softmax_dim0",
        "cumsum_dim0",
        "mul_batch_size",
        "arange_batch",
        "cat_dim0",
        "shift_rows",
        "flatten_across_rows",
        "cross_row_attention",
        "first_row",
        "squeeze_all",
    )
] + [
    # torch's own sequence modules: the batch moves off dim 0 and merges with the heads.
    Case(name, factory, ("hist",), (("hist", Spec((5, 16))), ("c", Spec((8,)))))
    for name, factory in {
        "mha_target_attention": lambda: SelfAndTargetAttention(),
        "mha_seq_first_key_padding": lambda: SelfAndTargetAttention(
            sequence_first=True, padding=True
        ),
        "transformer_encoder_seq_first": lambda: Encoder(sequence_first=True),
        "transformer_decoder_norm_first": lambda: Decoder(norm_first=True),
        "gru_seq_first": lambda: Recurrent(nn.GRU, sequence_first=True),
        "lstm_two_layers_given_state": lambda: Recurrent(nn.LSTM, layers=2, h0=True),
        "rnn_bidirectional": lambda: Recurrent(nn.RNN, bidirectional=True),
        "merged_heads": lambda: MergedHeads(),
        "in_place_history": lambda: InPlaceHistory(),
    }.items()
]


def _pipeline(case: Case, options=OPTIONS):
    example = case.batch([2, 3], seed=123).replicated()
    return compile_graph(case.build(), list(case.request_inputs), (), example, Options(**options))


@pytest.fixture(scope="module", params=NONINTERFERENCE_CASES, ids=lambda c: c.name)
def hand_result(request):
    case = request.param
    plain = _pipeline(case, ALL_OFF)
    rewritten = _pipeline(case) if OPTIONS != ALL_OFF else plain
    return case, plain.captured, _graphs(plain, rewritten)


def test_hand_noninterference(hand_result):
    case, captured, graphs = hand_result
    batch = case.batch(COUNTS, seed=1, shuffle=True)
    other = case.batch(COUNTS, seed=2, shuffle=True)
    # Same index for both: only the candidate leaves are taken from ``other``.
    check_noninterference(captured, graphs, batch, other, case.name)


def test_hand_request_nodes_are_rowwise(hand_result):
    case, captured, graphs = hand_result
    check_rowwise(captured, graphs, case.batch(COUNTS, seed=3, shuffle=True), case.name)


def test_oracle_catches_a_wrong_role():
    """The oracles are not vacuous: a batch softmax wrongly marked REQUEST is caught."""
    case = mixing_case("softmax_dim0")
    captured = _pipeline(case, ALL_OFF).captured
    graphs = [("captured", captured.graph_module)]
    request = {captured.placeholder_of[n] for n in captured.request_inputs}
    analyze(captured.graph_module, request, captured.batch_symbol)
    softmax = [n for n in captured.graph_module.graph.nodes if "softmax" in str(n.target)]
    assert softmax and all(n.meta[ROLE] == Role.CANDIDATE for n in softmax)
    for n in softmax:
        n.meta[ROLE] = Role.REQUEST
        n.meta[BATCH_AXIS] = BatchAxis(0)
    batch = case.batch(COUNTS, seed=3, shuffle=True)
    with pytest.raises(AssertionError, match="do not commute"):
        check_rowwise(captured, graphs, batch, "forced")

    # Non-interference: a candidate-dependent node wrongly marked REQUEST is caught as well.
    analyze(captured.graph_module, request, captured.batch_symbol)
    output = next(n for n in captured.graph_module.graph.nodes if n.op == "output")
    final = output.all_input_nodes[0]
    assert final.meta[ROLE] == Role.CANDIDATE
    final.meta[ROLE] = Role.REQUEST
    other = case.batch(COUNTS, seed=4, shuffle=True)
    with pytest.raises(AssertionError, match="REQUEST nodes changed"):
        check_noninterference(captured, graphs, batch, other, "forced")
