"""The cost of a call read from the graph (``cm.cost()``, ``analysis/call_cost.py``) and the
calibration that turns it into milliseconds (``rocs.calibrate``,
``runtime/program/calibration.py``). No test times anything or asserts on a time.

The FLOPs oracle knows nothing of the walk: ``analysis/flops.py::node_costs`` runs every node on
concrete fake tensors at two batch sizes; a REQUEST node of the shared graph runs at R rows and
any other at N, so a call's FLOPs are ``per_row * rows(placement) + fixed`` summed over nodes.
"""

from __future__ import annotations

import json
import math

import pytest
import sympy
import torch

import rocs_compiler as rocs
from models_zoo import bst, din, dlrm, target_attention
from rocs_compiler.analysis.flops import node_costs
from rocs_compiler.ir.graph_meta import PLACEMENT
from rocs_compiler.ir.roles import Role
from rocs_compiler.runtime.program.calibration import Calibration, Rates

HISTORIES = ("hist_item_ids", "hist_cat_ids")


@pytest.fixture(scope="module")
def dlrm_model():
    model = dlrm.build(seed=0).eval()
    example = dlrm.make_batch([4, 3]).replicated()
    return rocs.compile(model, list(dlrm.REQUEST_INPUTS), example_kwargs=example)


@pytest.fixture(scope="module")
def din_model():
    model = din.build(seed=0).eval()
    example = din.make_batch([4, 3]).replicated()
    for name in HISTORIES:
        torch._dynamo.mark_dynamic(example[name], 1)
    return rocs.compile(model, list(din.REQUEST_INPUTS), example_kwargs=example)


def _oracle_flops(cm, requests: int, candidates: int, length: int | None = None) -> float:
    result = cm.pipeline_result
    lengths = {s: length for s in result.length_symbols().values()} if length else None
    costs = node_costs(cm.graph_module, result.captured.batch_symbol, lengths)
    total = 0.0
    for node in cm.graph_module.graph.nodes:
        cost = costs.get(node.name)
        if cost is not None:
            rows = requests if node.meta.get(PLACEMENT) is Role.REQUEST else candidates
            total += cost.per_row * rows + cost.fixed
    return total


@pytest.mark.parametrize("requests, candidates", [(1, 7), (3, 40), (5, 5)])
def test_flops_equal_the_node_costs_of_the_graph(dlrm_model, requests, candidates):
    cost = dlrm_model.cost()
    assert cost.at(requests, candidates).flops == pytest.approx(
        _oracle_flops(dlrm_model, requests, candidates), rel=1e-9
    )


@pytest.mark.parametrize("requests, candidates, length", [(1, 7, 3), (2, 30, 50), (4, 9, 17)])
def test_flops_equal_the_node_costs_at_a_history_length(din_model, requests, candidates, length):
    cost = din_model.cost()
    at = cost.at(requests, candidates, hist_item_ids=length)
    assert at.flops == pytest.approx(
        _oracle_flops(din_model, requests, candidates, length), rel=1e-9
    )


def test_expressions_are_over_R_N_and_one_symbol_per_length(din_model, dlrm_model):
    cost = din_model.cost()
    length = cost.lengths["hist_item_ids"]
    assert str(length) == "L_hist_item_ids"
    assert cost.lengths["hist_cat_ids"] == length  # one size, one symbol
    assert cost.flops.free_symbols == {cost.R, cost.N, length}
    assert cost.example_lengths == {length: 50}
    assert cost.at(2, 30) == cost.at(2, 30, L_hist_item_ids=50)
    with pytest.raises(ValueError, match="hist_item_ids"):
        cost.at(2, 30, history=5)
    assert dlrm_model.cost().flops.free_symbols == {dlrm_model.cost().R, dlrm_model.cost().N}
    families = cost.families
    assert {"gemm", "gather", "memory"} <= set(families)
    assert sum(f["ops"] for f in families.values()) == cost.ops > 0


def test_per_request_is_affine_in_candidates_and_grows_with_the_history(din_model):
    cost = din_model.cost()
    for length in (5, 50):
        k1, k2, k3 = (cost.per_request(length, k) for k in (1, 2, 3))
        assert k3.flops - k2.flops == pytest.approx(k2.flops - k1.flops)
        assert k3.bytes - k2.bytes == pytest.approx(k2.bytes - k1.bytes)
        assert k1.ops == 0
    short, long = cost.per_request(5, 8), cost.per_request(50, 8)
    assert long.flops > short.flops > 0
    assert long.bytes > short.bytes > 0


def test_bytes_are_positive_and_grow_with_candidates(dlrm_model, din_model):
    for cost in (dlrm_model.cost(), din_model.cost()):
        sizes = [cost.at(2, n).bytes for n in (2, 64, 512)]
        assert 0 < sizes[0] < sizes[1] < sizes[2]
        for term in cost.terms:
            if term.family == "view":
                assert term.counts["bytes"] == 0
            else:
                assert term.counts["bytes"].subs({cost.R: 1, cost.N: 1}) >= 0


def _hand_calibration() -> Calibration:
    rates = Rates(ops_s=2e-6, flops_s=1e-11, bytes_s=2e-11, items_s=1e-8)
    families = {f: rates for f in ("gemm", "bmm", "attention", "gather", "memory", "view")}
    return Calibration(families, {"aten::relu": Rates(ops_s=1e-6, bytes_s=1e-11)},
                       launch_s=1e-6, spill_s=3e-11, cache_bytes=2**20, fresh_s=4e-11,
                       fresh_bytes=2**17, cold_row_s=5e-9, mapped_s=1e-10,
                       streamed=((2**21, 0.0), (2**22, 5e-11)), call_s=5e-5)  # fmt: skip


def test_predicted_milliseconds_are_the_expression_at_the_sizes(din_model):
    cost, calibration = din_model.cost(), _hand_calibration()
    seconds = cost.seconds(calibration)
    assert seconds.free_symbols <= {cost.R, cost.N, cost.lengths["hist_item_ids"]}
    for requests, candidates, length in ((1, 16, 10), (4, 512, 50)):
        sizes = cost.sizes(requests, candidates, hist_item_ids=length)
        predicted = cost.predict_ms(calibration, R=requests, N=candidates, hist_item_ids=length)
        assert predicted == pytest.approx(1e3 * float(seconds.subs(sizes)), rel=1e-9)
    floor = 1e3 * (calibration.call_s + cost.ops * (calibration.launch_s + 1e-6))
    assert cost.predict_ms(calibration, R=1, N=1) > floor  # every op launches at least once


def test_a_short_calibration_round_trips_through_json_and_predicts_more_for_more_candidates(
    dlrm_model,
):
    calibration = rocs.calibrate(seconds=0.05)
    assert isinstance(calibration, rocs.Calibration)
    assert Calibration.from_json(calibration.to_json()) == calibration
    assert json.loads(calibration.to_json())["threads"] == 1
    assert torch.get_num_threads() == 1  # the calling process's count, restored
    assert {"gemm", "gather", "memory", "view"} <= set(calibration.families)
    bags = {f"rocs::embedding_bag_rows{v}" for v in ("", "[mean]", "[padded]", "[mean,padded]")}
    assert bags <= set(calibration.ops)  # each variant of the bag measured by itself
    assert "aten::scaled_dot_product_attention[narrow]" in calibration.ops
    assert {"aten::layer_norm", "aten::layer_norm[unscaled]"} <= set(calibration.ops)
    numbers = [calibration.launch_s, calibration.spill_s, calibration.fresh_s,
               calibration.cold_row_s, calibration.mapped_s,
               *(x for point in calibration.streamed for x in point)]  # fmt: skip
    streamed_bytes = [nbytes for nbytes, _ in calibration.streamed]
    assert len(streamed_bytes) >= 2 and streamed_bytes == sorted(streamed_bytes)
    per_byte = [extra for _, extra in calibration.streamed]
    assert per_byte[0] == 0 and per_byte == sorted(per_byte)
    for rates in [*calibration.families.values(), *calibration.ops.values()]:
        numbers += [rates.ops_s, rates.flops_s, rates.bytes_s, rates.items_s]
    assert all(math.isfinite(x) and x >= 0 for x in numbers)
    cost = dlrm_model.cost()
    times = [cost.predict_ms(calibration, R=4, N=n) for n in (4, 256, 4096)]
    assert 0 < times[0] < times[1] < times[2]


def test_a_model_without_a_graph_has_no_cost():
    class Opaque(torch.nn.Module):
        def forward(self, user, item):
            return (user * item.sum()).sum(1) if bool(user.sum() > 0) else item.sum(1)

    example = {"user": torch.randn(4, 3), "item": torch.randn(4, 3)}
    with pytest.warns(UserWarning, match="fallback"):
        cm = rocs.compile(Opaque().eval(), ["user"], example_kwargs=example, fallback="eager")
    assert cm.is_fallback
    with pytest.raises(RuntimeError, match="no graph"):
        cm.cost()


def test_cost_symbols_are_plain_sympy_symbols(dlrm_model):
    cost = dlrm_model.cost()
    assert isinstance(cost.R, sympy.Symbol) and str(cost.R) == "R"
    assert isinstance(cost.N, sympy.Symbol) and str(cost.N) == "N"


class _MeanBag(torch.nn.Module):
    """A user history pooled by a mean bag with a padding index, and an item tower."""

    def __init__(self):
        super().__init__()
        self.history = torch.nn.EmbeddingBag(300, 8, mode="mean", padding_idx=0)
        self.items = torch.nn.Embedding(300, 8)

    def forward(self, hist, item):
        return (self.history(hist) * self.items(item)).sum(1)


def test_a_mean_bag_with_padding_has_rates_of_its_own_and_falls_back_to_the_plain_ones():
    example = {"hist": torch.randint(0, 300, (5, 6)), "item": torch.randint(0, 300, (5,))}
    cm = rocs.compile(_MeanBag().eval(), ["hist"], example_kwargs=example)
    ops = [t.op for t in cm.cost().terms]
    assert "rocs::embedding_bag_rows[mean,padded]" in ops, ops
    plain, variant = Rates(ops_s=1e-6), Rates(ops_s=9e-6)
    family = Rates(ops_s=5e-6)
    only_plain = Calibration({"gather": family}, {"rocs::embedding_bag_rows": plain})
    both = Calibration(
        {"gather": family},
        {"rocs::embedding_bag_rows": plain, "rocs::embedding_bag_rows[mean,padded]": variant},
    )
    key = "rocs::embedding_bag_rows[mean,padded]"
    assert only_plain.rates("gather", key) == plain  # the op's plain form before its family
    assert both.rates("gather", key) == variant
    assert Calibration({"gather": family}).rates("gather", key) == family
    assert cm.cost().predict_ms(both, R=1, N=4) > cm.cost().predict_ms(only_plain, R=1, N=4)


@pytest.mark.parametrize(
    "zoo, narrow", [(bst, True), (target_attention, False)], ids=["bst", "target_attention"]
)
def test_an_attention_of_narrow_heads_has_rates_of_its_own(zoo, narrow):
    """bst's attention has 4 heads of 8 numbers; target attention's heads are 32 wide. The narrow
    ones are priced by the variant the calibration measures at that width, where it has one."""
    model = zoo.build(seed=0).eval()
    example = zoo.make_batch([3, 2]).replicated()
    cm = rocs.compile(model, list(zoo.REQUEST_INPUTS), example_kwargs=example)
    attention = [t.op for t in cm.cost().terms if t.family == "attention"]
    assert attention, "no attention priced"
    key = "aten::scaled_dot_product_attention[narrow]"
    assert (key in attention) == narrow, attention
    family, variant = Rates(ops_s=1e-6), Rates(ops_s=9e-6)
    plain = Calibration({"attention": family})
    measured = Calibration({"attention": family}, {key: variant})
    assert measured.rates("attention", key) == variant
    assert plain.rates("attention", key) == family  # not measured: the family's rates
    sizes = {"R": 1, "N": 4, **dict.fromkeys(cm.cost().lengths, 8)}
    slower = cm.cost().predict_ms(measured, **sizes) > cm.cost().predict_ms(plain, **sizes)
    assert slower == narrow


def test_a_gemm_that_streams_its_operands_costs_more_per_byte_as_interpolated():
    """A GEMM's bytes cost what ``streamed`` gives for its size more (its operands no longer in
    the caches): nothing below the first point, linear between points, the last's past it;
    other families are priced as before, and the expression agrees with the numbers."""
    from rocs_compiler.analysis.call_cost import node_seconds

    rates = Rates(flops_s=1e-11, bytes_s=1e-12)
    streamed = Calibration({"gemm": rates}, streamed=((1e6, 0.0), (2e6, 4e-11), (4e6, 1e-10)))
    plain = Calibration({"gemm": rates})

    def extra(family, nbytes):
        counts = {"ops": 1, "flops": 100 * nbytes, "bytes": nbytes, "items": 0, "allocated": 0}
        return node_seconds(family, counts, rates, streamed) - node_seconds(
            family, counts, rates, plain
        )

    assert extra("gemm", 5e5) == 0
    assert extra("gemm", 1.5e6) == pytest.approx(1.5e6 * 2e-11)
    assert extra("gemm", 3e6) == pytest.approx(3e6 * 7e-11)
    assert extra("gemm", 1e8) == pytest.approx(1e8 * 1e-10)
    assert extra("memory", 1e8) == 0
    rows = sympy.Symbol("N", positive=True)
    symbolic = {"ops": 1, "flops": 320 * rows, "bytes": 4 * rows, "items": 0, "allocated": 0}
    seconds = node_seconds("gemm", symbolic, rates, streamed)
    for n in (10, 3 * 10**5, 6 * 10**5, 10**7):  # below, between each pair of points, past them
        at = {c: float(sympy.sympify(v).subs(rows, n)) for c, v in symbolic.items()}
        expected = node_seconds("gemm", at, rates, streamed)
        assert float(seconds.subs(rows, n)) == pytest.approx(expected)
    assert float(seconds.subs(rows, 10**7)) > float(
        node_seconds("gemm", symbolic, rates, plain).subs(rows, 10**7)
    )


def test_the_streamed_points_rise_with_the_bytes():
    from rocs_compiler.runtime.program.calibration import rising

    assert rising([0.0, 3.0, 1.0, 5.0]) == [0.0, 2.0, 2.0, 5.0]
    assert rising([0.0, 4.0, 2.0, 0.0, 6.0]) == [0.0, 2.0, 2.0, 2.0, 6.0]
    assert rising([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]


def test_a_calibration_from_another_version_is_refused_naming_its_fields():
    text = Calibration({"gemm": Rates()}).to_json()
    old = json.dumps({**json.loads(text), "streamed_bytes": 1e6})
    with pytest.raises(ValueError, match="streamed_bytes.*rocs.calibrate"):
        Calibration.from_json(old)


def test_a_layer_norm_without_a_weight_is_priced_as_its_own_variant():
    """ATen's CPU layer norm without weight and bias takes a slower path than the affine norm
    of ``nn.LayerNorm``: a calibration measures both, and a graph's norms are keyed by which."""

    class Norms(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.affine = torch.nn.LayerNorm(8)

        def forward(self, user, item):
            x = torch.cat([user, item], 1)
            return self.affine(x).sum(1) + torch.nn.functional.layer_norm(x, [8]).sum(1)

    example = {"user": torch.randn(6, 4), "item": torch.randn(6, 4)}
    cm = rocs.compile(Norms().eval(), ["user"], example_kwargs=example)
    norms = sorted(t.op for t in cm.cost().terms if t.op.startswith("aten::layer_norm"))
    assert norms == ["aten::layer_norm", "aten::layer_norm[unscaled]"]
