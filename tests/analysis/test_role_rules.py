"""Role rules, through small captured models, and exactness of the batch-mixing cases.

Rule tests look nodes up by their op (never by generated names) and check the role the analysis
gave them and the fallback it recorded. Every batch-mixing case is then compiled and compared
with the original model on ragged batches: an op the compiler cannot share must run per
candidate, never be silently wrong.
"""

from __future__ import annotations

import functools
import math
import operator

import pytest
import torch
from models_for_tests import (
    ALL_OFF,
    BATCH_MIXING,
    BATCH_NORM_EVAL,
    BATCH_NORM_NO_STATS,
    DROPOUT_ALWAYS_ON,
    OPTION_IDS,
    OPTION_SETS,
    OPTIONS,
    USER_ITEM_MLP,
    VIEW_FROM_CANDIDATE_SIZE,
    VIEW_MERGE,
    ZOO_NAMES,
    Case,
    D,
    Spec,
    check_both_conventions,
    eager,
    key,
    mixing_case,
    zoo_pipeline,
)
from torch import fx, nn

import rocs_compiler as rocs
from rocs_compiler.analysis.driver import analyze
from rocs_compiler.analysis.batch_axis import BatchAxis
from rocs_compiler.ir.graph_meta import BATCH_AXIS
from rocs_compiler.capture.trace import capture
from rocs_compiler.analysis.op_groups import is_mutating, is_random
from rocs_compiler.analysis.role_rules import lookup
from rocs_compiler.ir.roles import Role
from rocs_compiler.runtime.choice import program_choice

aten = torch.ops.aten


def analysed(case: Case):
    """(graph module, analysis) of a case's captured graph."""
    example = case.batch([2, 3], seed=123).replicated()
    captured = capture(case.build(), (), example, list(case.request_inputs))
    request = {captured.placeholder_of[n] for n in captured.request_inputs}
    return captured.graph_module, analyze(captured.graph_module, request, captured.batch_symbol)


def nodes_of(gm: fx.GraphModule, *words: str) -> list[fx.Node]:
    """call_function nodes whose op name contains one of ``words`` (``aten.sum.dim_IntList``)."""
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and any(w in str(n.target) for w in words)
    ]


def role(node: fx.Node) -> Role:
    return node.meta["rocs_role"]


def fallback_for(analysis, node: fx.Node):
    hits = [f for f in analysis.fallbacks if f.node == node.name]
    return hits[0] if hits else None


def assert_fallback(analysis, nodes, word: str) -> None:
    assert nodes, f"no {word} node in the graph"
    for n in nodes:
        assert role(n) == Role.CANDIDATE, f"{n.target} over the batch dim must not be REQUEST"
        fb = fallback_for(analysis, n)
        assert fb is not None, f"no fallback recorded for {n.target}"
        assert fb.op == str(n.target) and word in fb.op, fb
        assert fb.reason, fb


def assert_request(analysis, nodes, word: str) -> None:
    assert nodes, f"no {word} node in the graph"
    for n in nodes:
        assert role(n) == Role.REQUEST, f"{n.target}: {n.meta.get('rocs_reason')}"
        assert fallback_for(analysis, n) is None


# ------------------------------------------------------------------------------------------
# Reductions and scans: over the batch dim -> CANDIDATE with a reason; other dims -> REQUEST

F = 3
REDUCTIONS = {
    "sum": lambda x, d: x.sum(d, keepdim=True),
    "mean": lambda x, d: x.mean(d, keepdim=True),
    "amax": lambda x, d: x.amax(d, keepdim=True),
    "logsumexp": lambda x, d: torch.logsumexp(x, d, keepdim=True),
    "var": lambda x, d: x.var(d, keepdim=True),
    "softmax": lambda x, d: torch.softmax(x, d),
    "log_softmax": lambda x, d: torch.log_softmax(x, d),
    "cumsum": lambda x, d: torch.cumsum(x, d),
}


class Reduce(nn.Module):
    def __init__(self, fn, dim):
        super().__init__()
        self.fn, self.dim = fn, dim

    def forward(self, user, item):
        return item + self.fn(user * 2, self.dim)


def reduce_case(op: str, dim: int) -> Case:
    return Case(
        f"{op}_dim{dim}",
        functools.partial(Reduce, REDUCTIONS[op], dim),
        ("user",),
        (("user", Spec((F, D))), ("item", Spec((F, D)))),
    )


@pytest.mark.parametrize("op", list(REDUCTIONS))
def test_reduction_over_batch_dim_is_candidate_with_reason(op):
    gm, analysis = analysed(reduce_case(op, 0))
    assert_fallback(analysis, nodes_of(gm, f"aten.{op}."), op)


@pytest.mark.parametrize("dim", [1, 2, -1])
@pytest.mark.parametrize("op", list(REDUCTIONS))
def test_reduction_over_other_dims_is_request(op, dim):
    gm, analysis = analysed(reduce_case(op, dim))
    assert_request(analysis, nodes_of(gm, f"aten.{op}."), op)


@pytest.mark.filterwarnings("ignore:.*degrees of freedom")
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("op", list(REDUCTIONS))
def test_reductions_exact(op, dim):
    case = reduce_case(op, dim)
    cm = case.compile()
    for counts, shuffle in (([3, 1, 5], True), ([1], False), ([4], False)):
        check_both_conventions(
            cm, case.build(), case.batch(counts, seed=5, shuffle=shuffle), case.name
        )


# ------------------------------------------------------------------------------------------
# Views


class Flatten(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(F * D, D)

    def forward(self, user, item):
        if self.how == "view":
            flat = user.view(user.size(0), -1)
        elif self.how == "flatten":
            flat = user.flatten(1)
        else:
            flat = user.reshape(-1, F * D)
        return self.lin(flat) + item


@pytest.mark.parametrize("how", ["view", "flatten", "reshape"])
def test_view_keeping_batch_dim_is_request(how):
    case = Case(
        f"flatten_{how}",
        functools.partial(Flatten, how),
        ("user",),
        (("user", Spec((F, D))), ("item", Spec())),
    )
    gm, analysis = analysed(case)
    assert_request(analysis, nodes_of(gm, "view", "reshape", "flatten"), "view")
    assert_request(analysis, nodes_of(gm, "linear", "addmm", "mm."), "linear")
    cm = case.compile()
    check_both_conventions(cm, case.build(), case.batch([3, 1, 5], seed=2, shuffle=True))


def test_view_merging_the_batch_dim_keeps_it_as_the_outer_factor():
    """[B, F, D] -> [B*F, D] -> linear -> [B, F*E]: the batch is the outer factor of the merged
    dim, so the whole chain stays request-side (and the model exact, see the differential
    tests)."""
    gm, analysis = analysed(VIEW_MERGE)
    merged = [
        n
        for n in nodes_of(gm, "view", "reshape")
        if n.all_input_nodes and n.all_input_nodes[0].op == "placeholder"
    ]
    assert merged, "the [B, F, D] -> [B*F, D] view of the user input"
    for n in merged:
        assert role(n) == Role.REQUEST
        assert n.meta[BATCH_AXIS] == BatchAxis(0, outer=1, inner=3)
    assert not analysis.fallbacks


def test_view_shaped_by_candidate_size_is_request():
    """``user.view(item.size(0), -1)``: the size is the batch size, R rows on the request side."""
    gm, analysis = analysed(VIEW_FROM_CANDIDATE_SIZE)
    assert_request(analysis, nodes_of(gm, "reshape"), "reshape")  # capture turns views into reshapes
    assert_request(analysis, nodes_of(gm, "linear", "addmm"), "linear")


# ------------------------------------------------------------------------------------------
# Sizes as values, factories, cat, squeeze, randomness


def test_divide_by_batch_size_is_not_shared():
    gm, analysis = analysed(mixing_case("div_batch_size"))
    assert_fallback(analysis, nodes_of(gm, "aten.div."), "div")
    assert_request(analysis, nodes_of(gm, "linear", "addmm"), "linear")


def test_multiply_by_batch_size_is_not_shared():
    gm, analysis = analysed(mixing_case("mul_batch_size"))
    muls = [
        n
        for n in nodes_of(gm, "aten.mul.")
        if any(not isinstance(a.meta.get("val"), torch.Tensor) for a in n.all_input_nodes)
    ]
    assert_fallback(analysis, muls, "mul")


def test_arange_of_batch_size_is_not_shared():
    gm, _analysis = analysed(mixing_case("arange_batch"))
    aranges = nodes_of(gm, "arange")
    assert aranges
    assert all(role(n) != Role.REQUEST for n in aranges)


def test_cat_along_batch_dim_is_not_shared():
    gm, analysis = analysed(mixing_case("cat_dim0"))
    assert_fallback(analysis, nodes_of(gm, "aten.cat."), "cat")


class CatFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.out = nn.Linear(2 * D, D)

    def forward(self, user, item):
        return self.out(torch.cat([self.lin(user), user], dim=1)) * item


def test_cat_along_feature_dim_is_request():
    case = Case("cat_features", CatFeatures)
    gm, analysis = analysed(case)
    assert_request(analysis, nodes_of(gm, "aten.cat."), "cat")
    check_both_conventions(
        case.compile(), case.build(), case.batch([3, 1, 5], seed=4, shuffle=True)
    )


def test_squeeze_without_dims_is_not_shared():
    """``squeeze()`` would drop the batch dim of a request tensor when R = 1."""
    gm, analysis = analysed(mixing_case("squeeze_all"))
    squeezes = [n for n in nodes_of(gm, "aten.squeeze.") if n.target == aten.squeeze.default]
    assert_fallback(analysis, squeezes, "squeeze")


class SqueezeDim(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, user, item):
        return self.lin(user).unsqueeze(1).squeeze(1) * item


def test_squeeze_of_feature_dim_is_request():
    gm, analysis = analysed(Case("squeeze_dim", SqueezeDim))
    assert_request(analysis, nodes_of(gm, "aten.squeeze."), "squeeze")


@pytest.mark.parametrize(
    "case", [mixing_case("rand_like_times_zero"), DROPOUT_ALWAYS_ON], ids=lambda c: c.name
)
def test_random_ops_never_request(case):
    gm, analysis = analysed(case)
    random = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and (is_random(n.target) or "dropout" in str(n.target))
    ]
    assert random, "the graph keeps its random op"
    for n in random:
        assert role(n) != Role.REQUEST, n.target
        assert fallback_for(analysis, n) is not None


def test_mutating_ops_are_recognised():
    assert is_mutating(aten.add_.Tensor)
    assert not is_mutating(aten.add.Tensor)
    assert is_random(aten.rand_like.default)
    assert not is_random(aten.add.Tensor)


# ------------------------------------------------------------------------------------------
# Normalisation layers and embeddings


def test_batch_norm_eval_is_request():
    gm, analysis = analysed(BATCH_NORM_EVAL)
    assert_request(analysis, nodes_of(gm, "batch_norm"), "batch_norm")


def test_batch_norm_with_batch_statistics_is_not_request():
    """BatchNorm1d(track_running_stats=False) uses batch statistics even in eval mode."""
    gm, _analysis = analysed(BATCH_NORM_NO_STATS)
    nodes = nodes_of(gm, "batch_norm")
    assert nodes
    assert all(role(n) != Role.REQUEST for n in nodes)


def test_embedding_with_request_ids_is_request():
    gm, analysis = analysed(USER_ITEM_MLP)
    assert_request(analysis, nodes_of(gm, "embedding"), "embedding")


class ItemEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(20, D)

    def forward(self, user, item_ids):
        return self.table(item_ids) * user


def test_embedding_with_candidate_ids_is_candidate_without_fallback():
    case = Case(
        "item_embedding",
        ItemEmbedding,
        ("user",),
        (("user", Spec()), ("item_ids", Spec((), 20))),
    )
    gm, analysis = analysed(case)
    nodes = nodes_of(gm, "embedding")
    assert nodes and all(role(n) == Role.CANDIDATE for n in nodes)
    assert all(fallback_for(analysis, n) is None for n in nodes)


# ------------------------------------------------------------------------------------------
# Registry coverage


def _is_sym_or_getitem(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        return True
    val = node.meta.get("val")
    if isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    module = getattr(node.target, "__module__", "") or ""
    return module in ("_operator", "operator", "builtins", "math") or "sym_" in str(node.target)


def _needs_rule(node: fx.Node) -> bool:
    """Random and mutating ops are kept out of the request region by the driver itself, and a
    node that only weights reach is CONST before any rule is asked."""
    if node.op != "call_function" or _is_sym_or_getitem(node):
        return False
    if is_random(node.target) or is_mutating(node.target):
        return False
    return role(node) != Role.CONST


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_every_zoo_op_has_a_rule(name):
    # The passes rewrite the captured graph in place: the captured graph is the one of a
    # pipeline with the optional passes off.
    plain, rewritten = zoo_pipeline(name, key(ALL_OFF)), zoo_pipeline(name, key(OPTIONS))
    missing = set()
    for gm in (plain.logical_graph, rewritten.logical_graph):
        for node in gm.graph.nodes:
            if _needs_rule(node) and lookup(node.target) is None:
                missing.add(str(node.target))
    assert not missing, (
        f"{name}: ops in the zoo graph without a role rule in role_rules.py: {sorted(missing)}"
    )


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_loses_no_sharing_to_missing_rules(name):
    # With the default passes: normalisation (inside defer) rewrites spellings such as
    # EmbeddingBag's arange-built offsets before the rules see them.
    fallbacks = zoo_pipeline(name, key(OPTIONS)).analysis.fallbacks
    assert not [f for f in fallbacks if f.reason.startswith("no role rule")], fallbacks


# ------------------------------------------------------------------------------------------
# Every batch-mixing case is exact end to end

EXACT_CASES = [mixing_case(name) for name in BATCH_MIXING] + [
    VIEW_MERGE,
    VIEW_FROM_CANDIDATE_SIZE,
    BATCH_NORM_EVAL,
    BATCH_NORM_NO_STATS,
]
RAGGED = {
    "ragged_shuffled": ([3, 1, 5], True),
    "one_candidate": ([1], False),
    "one_request": ([4], False),
    "ragged5_shuffled": ([2, 2, 1, 4, 1], True),
    "larger": ([7, 2, 9], True),
}


@pytest.fixture(
    scope="module",
    params=[(c, i) for c in EXACT_CASES for i in range(len(OPTION_SETS))],
    ids=[f"{c.name}-{OPTION_IDS[i]}" for c in EXACT_CASES for i in range(len(OPTION_SETS))],
)
def mixing_compiled(request):
    case, i = request.param
    model = case.build()
    return case, model, case.compile(model, options=OPTION_SETS[i])


@pytest.mark.filterwarnings("ignore:.*degrees of freedom")
@pytest.mark.parametrize("batch_name", list(RAGGED))
def test_batch_mixing_exact(mixing_compiled, batch_name):
    case, model, cm = mixing_compiled
    counts, shuffle = RAGGED[batch_name]
    batch = case.batch(counts, seed=9, shuffle=shuffle)
    if case is BATCH_NORM_NO_STATS and sum(counts) == 1:
        # Batch statistics of one value: the original refuses the call (the compiled model's
        # answer to it is test_a_single_row_batch_norm_call_is_refused_as_the_original_refuses).
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            eager(model, batch.replicated())
        return
    check_both_conventions(cm, model, batch, f"{case.name} {batch_name}")


def test_a_single_row_batch_norm_call_is_refused_as_the_original_refuses():
    """The captured op answers one value per channel; ``F.batch_norm`` refuses it, and so does
    every program of the compiled model (``runtime/program/eager_checks.py``), in every layout, while
    its buckets measure and once they have settled."""
    model = BATCH_NORM_NO_STATS.build()
    cm = BATCH_NORM_NO_STATS.compile(model)
    batch = BATCH_NORM_NO_STATS.batch([1], seed=9, shuffle=False)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        eager(model, batch.replicated())
    with torch.no_grad():
        for _ in range(2 * program_choice.TRIALS + 2):
            with pytest.raises(ValueError, match="more than 1 value per channel"):
                cm(**batch.replicated())
            with pytest.raises(ValueError, match="more than 1 value per channel"):
                cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    two = BATCH_NORM_NO_STATS.batch([1, 1], seed=9, shuffle=False)  # two rows: answered
    check_both_conventions(cm, model, two, "two single-candidate requests")


def test_report_names_the_fallback_node_and_reason():
    case = mixing_case("softmax_dim0")
    report = case.compile().report(candidates=4, requests=2)
    hits = [f for f in report.fallbacks if "softmax" in f.op]
    assert hits and all(f.reason for f in hits), report.fallbacks


def test_every_batch_mixing_case_records_a_fallback():
    """Each case mixes rows of a request-only value, so sharing is lost and the reason kept."""
    for name in BATCH_MIXING:
        if name == "cat_request_candidate_dim0":
            continue  # the cat already reads a candidate input: nothing request-only is lost
        _gm, analysis = analysed(mixing_case(name))
        assert analysis.fallbacks, f"{name}: no fallback recorded"


# ------------------------------------------------------------------------------------------
# Batch sizes in any arithmetic form: the compiled model may run such a node per candidate, but
# it must compile and stay exact (the model is traceable with a dynamic batch dim).

SIZE_EXPRESSIONS = {
    "minus_one": lambda h: h * (h.size(0) - 1),
    "floordiv": lambda h: h * (h.size(0) // 2),
    "mod": lambda h: h * (h.size(0) % 3),
    "explicit_merge": lambda h: h.reshape(h.size(0) * 2, D // 2).sum(1).view(h.size(0), 2),
    "square": lambda h: h * h.size(0) ** 2,
    "true_div": lambda h: h * (h.size(0) / 2),
    "float": lambda h: h / float(h.size(0)),
    "sqrt": lambda h: h / math.sqrt(h.size(0)),
    "max": lambda h: h * max(h.size(0), 3),
}


class SizeExpression(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(D, D)

    def forward(self, user, item):
        return self.fn(self.lin(user)).sum(-1) + item.sum(-1)


@pytest.mark.parametrize("expr", list(SIZE_EXPRESSIONS))
def test_batch_size_expressions_compile_and_stay_exact(expr):
    case = Case(f"size_{expr}", functools.partial(SizeExpression, SIZE_EXPRESSIONS[expr]))
    model = case.build()
    try:
        cm = case.compile(model)
    except rocs.CompileError as err:
        raise AssertionError(
            f"a traceable model using the batch size as {expr} does not compile: {err} "
            "(share re-derives every batch-size scalar from its sympy expression, and "
            "symbolic.emit_expr handles only +, *, //, %)"
        ) from None
    for counts, shuffle in (([3, 1, 5], True), ([1], False), ([4], False)):
        check_both_conventions(cm, model, case.batch(counts, seed=2, shuffle=shuffle), expr)
