"""Small hand-written models, batch makers and comparison helpers shared by the tests.

Every model here is an ordinary eval-mode ``nn.Module`` written for the replicated layout
(one row per (request, candidate) pair). A :class:`Case` bundles a model with its request
inputs and a batch maker that draws a shared-layout :class:`models_zoo.Batch`, so the tests can
call both conventions and the original model on the same data.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

import rocs_compiler as rocs
from models_zoo import ZOO, Batch, request_index
from models_zoo.batch import get_leaf, set_leaf

# ------------------------------------------------------------------------------------------
# Pass options. The defer and ikbo passes are switched on by default in the pipeline; while a
# pass module does not exist yet the tests switch it off, and the differential tests also run
# with every optional pass off.

ALL_OFF = {"defer": False, "ikbo": False}


def _pending_passes() -> list[str]:
    return [
        name
        for name in ("defer", "ikbo")
        if importlib.util.find_spec(f"rocs_compiler.passes.{name}") is None
    ]


OPTIONS: dict[str, bool] = {name: False for name in _pending_passes()}
OPTION_SETS: list[dict[str, bool]] = [OPTIONS] + ([ALL_OFF] if OPTIONS != ALL_OFF else [])


def options_id(options: dict) -> str:
    off = sorted(k for k, v in options.items() if v is False)
    return "default" if not off else "no-" + "-".join(off)


OPTION_IDS = [options_id(o) for o in OPTION_SETS]

RTOL, ATOL = 1e-4, 1e-5

# ------------------------------------------------------------------------------------------
# Comparison


def assert_outputs_match(got: Any, expected: Any, what: str = "", rtol=RTOL, atol=ATOL) -> None:
    """Same pytree structure, and every tensor leaf has the same shape, dtype and values."""
    got_leaves, got_spec = pytree.tree_flatten(got)
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    assert got_spec == exp_spec, f"{what}: output structure {got_spec} != original {exp_spec}"
    for i, (a, b) in enumerate(zip(got_leaves, exp_leaves)):
        where = f"{what}: output leaf {i}"
        if not isinstance(b, torch.Tensor):
            assert not isinstance(a, torch.Tensor) and a == b, f"{where}: {a!r} != {b!r}"
            continue
        assert isinstance(a, torch.Tensor), f"{where}: expected a tensor, got {type(a)}"
        assert a.shape == b.shape, f"{where}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
        if b.is_floating_point():
            ok = torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
            if not ok:
                diff = (a - b).abs().nan_to_num(nan=float("inf")).max().item()
                raise AssertionError(f"{where}: values differ (max abs diff {diff:.3g})")
        else:
            assert torch.equal(a, b), f"{where}: values differ"


def eager(model: nn.Module, kwargs: dict) -> Any:
    with torch.no_grad():
        return model(**kwargs)


def check_both_conventions(cm, model, batch: Batch, what: str = "") -> None:
    """Compiled (shared layout and drop-in) equals the original model on replicated inputs."""
    expected = eager(model, batch.replicated())
    shared = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    assert_outputs_match(shared, expected, f"{what} shared layout")
    dropin = cm(**batch.replicated())
    assert_outputs_match(dropin, expected, f"{what} drop-in")


def copy_structure(tree):
    if isinstance(tree, dict):
        return {k: copy_structure(v) for k, v in tree.items()}
    return tree


def with_index(batch: Batch, index: torch.Tensor) -> Batch:
    """The same request/candidate features, with another candidate -> request map."""
    return Batch(copy_structure(batch.kwargs), index, batch.request_inputs)


def leaf_names(tree, prefix: str = "") -> list[str]:
    if isinstance(tree, dict):
        out = []
        for key, value in tree.items():
            out += leaf_names(value, f"{prefix}{key}.")
        return out
    return [prefix[:-1]]


def replace_candidates(batch: Batch, other: Batch) -> Batch:
    """``batch`` with every candidate leaf taken from ``other`` (same counts, same index)."""
    kwargs = copy_structure(batch.kwargs)
    for name in leaf_names(kwargs):
        if name not in batch.request_inputs:
            set_leaf(kwargs, name, get_leaf(other.kwargs, name))
    return Batch(kwargs, batch.candidate_to_request, batch.request_inputs)


# ------------------------------------------------------------------------------------------
# Batches for hand-written models

D = 6  # feature width of the hand-written models
VOCAB = 50


@dataclass(frozen=True)
class Spec:
    """One input leaf: trailing shape and either "float" or an id vocabulary size."""

    tail: tuple[int, ...] = (D,)
    vocab: int | None = None


def draw_batch(
    specs: dict[str, Spec],
    request_inputs: Sequence[str],
    counts: Sequence[int],
    *,
    seed: int = 0,
    shuffle: bool = False,
) -> Batch:
    """A shared-layout batch; a request name may cover a whole dict (``user`` -> ``user.age``)."""
    g = torch.Generator().manual_seed(seed)
    R, N = len(counts), sum(counts)
    request_leaves = tuple(
        n for n in specs if any(n == r or n.startswith(r + ".") for r in request_inputs)
    )
    kwargs: dict = {}
    for name, spec in specs.items():
        rows = R if name in request_leaves else N
        if spec.vocab is None:
            value = torch.randn(rows, *spec.tail, generator=g)
        else:
            value = torch.randint(0, spec.vocab, (rows, *spec.tail), generator=g)
        node = kwargs
        *path, last = name.split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    index = request_index(counts, shuffle=shuffle, generator=g)
    return Batch(kwargs, index, request_leaves)


@dataclass(frozen=True)
class Case:
    """A hand-written model with its inputs."""

    name: str
    factory: Callable[[], nn.Module]
    request_inputs: tuple[str, ...] = ("user",)
    specs: tuple[tuple[str, Spec], ...] = (("user", Spec()), ("item", Spec()))

    def build(self, seed: int = 0) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.factory()
        return model.eval()

    def batch(self, counts, *, seed: int = 0, shuffle: bool = False) -> Batch:
        return draw_batch(dict(self.specs), self.request_inputs, counts, seed=seed, shuffle=shuffle)

    def compile(self, model=None, example_counts=(2, 3), options=None, **kw):
        model = model if model is not None else self.build()
        example = self.batch(example_counts, seed=123).replicated()
        opts = OPTIONS if options is None else options
        return rocs.compile(
            model, list(self.request_inputs), example_kwargs=example, options=opts, **kw
        )


# ------------------------------------------------------------------------------------------
# Models


class NothingShared(nn.Module):
    """The request features enter through a product with the candidate's: nothing request-only."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, user, item):
        return self.mlp(user * item).squeeze(1)


class UserItemMLP(nn.Module):
    """Row-wise: user tower with an embedding, item tower, concatenation and a head."""

    def __init__(self):
        super().__init__()
        self.user_mlp = nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 8))
        self.user_table = nn.Embedding(VOCAB, 8)
        self.item_mlp = nn.Linear(D, 8)
        self.head = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, user, user_ids, item):
        u = self.user_mlp(user) + self.user_table(user_ids)
        x = torch.cat([u, self.item_mlp(item)], dim=1)
        return self.head(x).squeeze(-1)


USER_ITEM_MLP = Case(
    "user_item_mlp",
    UserItemMLP,
    ("user", "user_ids"),
    (("user", Spec()), ("user_ids", Spec((), VOCAB)), ("item", Spec())),
)


class Mixing(nn.Module):
    """``item + f(linear(user), item)`` for one function ``f`` of the request tensor."""

    def __init__(self, fn):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.fn = fn

    def forward(self, user, item):
        return self.fn(self.lin(user), item)


def _cat_batch(h, item):
    return torch.cat([h, h * 2], dim=0).view(2, -1, D).sum(0) + item


def _cat_request_candidate(h, item):
    return torch.cat([h, item], dim=0).view(2, -1, D).prod(0)


def _shift_rows(h, item):
    return torch.cat([h[:1], h[:-1]], dim=0) + item


def _flatten_across_rows(h, item):
    """[B, D] -> [D, B] -> [B, D]: each new row takes one feature of several requests."""
    return h.t().reshape(-1).view(h.size(0), D) * 3 + item


def _cross_row_attention(h, item):
    return torch.softmax(h @ h.t(), dim=1) @ item


def _first_row(h, item):
    return h - h[0] + item


# Functions of (h: request [B, D], item: candidate [B, D]) that mix rows of the batch. Each one
# must run per candidate in the compiled model; the differential tests check exactness.
BATCH_MIXING: dict[str, Callable] = {
    "sum_dim0": lambda h, item: item + h.sum(0, keepdim=True),
    "mean_dim0": lambda h, item: item * h.mean(0),
    "softmax_dim0": lambda h, item: item + torch.softmax(h, dim=0),
    "cumsum_dim0": lambda h, item: item + torch.cumsum(h, dim=0),
    "amax_dim0": lambda h, item: item + h.amax(0),
    "div_batch_size": lambda h, item: item + h / h.size(0),
    "mul_batch_size": lambda h, item: item + h * h.size(0),
    "arange_batch": lambda h, item: item + h * torch.arange(h.size(0)).unsqueeze(1),
    "cat_dim0": _cat_batch,
    "cat_request_candidate_dim0": _cat_request_candidate,
    "shift_rows": _shift_rows,
    "flatten_across_rows": _flatten_across_rows,
    "sort_dim0": lambda h, item: torch.sort(h, dim=0).values + item,
    "flip_dim0": lambda h, item: h.flip(0) + item,
    "roll_dim0": lambda h, item: torch.roll(h, 1, 0) + item,
    "cross_row_attention": _cross_row_attention,
    "first_row": _first_row,
    "squeeze_all": lambda h, item: h.unsqueeze(1).squeeze() + item,
    "rand_like_times_zero": lambda h, item: h + torch.rand_like(h) * 0 + item,
    "batch_std": lambda h, item: item + h.std(0, keepdim=True),
}


def mixing_case(name: str) -> Case:
    fn = BATCH_MIXING[name]
    return Case(f"mixing_{name}", functools.partial(Mixing, fn))


class ViewMerge(nn.Module):
    """[B, F, D] -> [B*F, D] (merges the batch dim) -> linear -> [B, F*E]."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 4)

    def forward(self, user, item):
        flat = self.lin(user.reshape(-1, D))  # [B*F, 4]
        return flat.view(user.size(0), -1) + item


VIEW_MERGE = Case(
    "view_merge", ViewMerge, ("user",), (("user", Spec((3, D))), ("item", Spec((12,))))
)


class ViewFromCandidateSize(nn.Module):
    """A request view shaped by ``item.size(0)``: must use R rows in the request region."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2 * D, 2 * D)

    def forward(self, user, item):
        flat = user.view(item.size(0), -1)  # [B, 2*D]
        return self.lin(flat) * item


VIEW_FROM_CANDIDATE_SIZE = Case(
    "view_from_candidate_size",
    ViewFromCandidateSize,
    ("user",),
    (("user", Spec((2, D))), ("item", Spec((2 * D,)))),
)


class BatchNormUser(nn.Module):
    def __init__(self, track_running_stats: bool = True):
        super().__init__()
        self.bn = nn.BatchNorm1d(D, track_running_stats=track_running_stats)
        if track_running_stats:
            with torch.no_grad():
                self.bn.running_mean.uniform_(-1, 1)
                self.bn.running_var.uniform_(0.5, 2)
        with torch.no_grad():
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-1, 1)
        self.lin = nn.Linear(D, D)

    def forward(self, user, item):
        return self.lin(self.bn(user)) * item


BATCH_NORM_EVAL = Case("batch_norm_eval", BatchNormUser)
BATCH_NORM_NO_STATS = Case("batch_norm_no_stats", functools.partial(BatchNormUser, False))


class DropoutAlwaysOn(nn.Module):
    """Dropout forced on inside an eval model: random, never request-only."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, user, item):
        return F.dropout(self.lin(user), p=0.5, training=True) + item


DROPOUT_ALWAYS_ON = Case("dropout_always_on", DropoutAlwaysOn)


class DictFeatures(nn.Module):
    """One dict of features; request leaves are named ``features.user_*``."""

    def __init__(self):
        super().__init__()
        self.age = nn.Embedding(10, 4)
        self.user_lin = nn.Linear(D, 4)
        self.item_lin = nn.Linear(D, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, features):
        u = torch.cat([self.age(features["user_age"]), self.user_lin(features["user_dense"])], 1)
        x = torch.relu(u + self.item_lin(features["item_dense"]))
        logits = self.head(x)
        return {"ctr": torch.sigmoid(logits[:, 0]), "cvr": torch.sigmoid(logits[:, 1]), "user": u}


DICT_FEATURES = Case(
    "dict_features",
    DictFeatures,
    ("features.user_age", "features.user_dense"),
    (
        ("features.user_age", Spec((), 10)),
        ("features.user_dense", Spec()),
        ("features.item_dense", Spec()),
    ),
)


class Sequence3D(nn.Module):
    """A request history [B, L, D] through attention-like bmm/softmax over L, then a dot."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(D, D)
        self.k = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, history, item):
        q, k = self.q(history), self.k(history)
        att = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / D**0.5, dim=-1)
        pooled = self.norm(torch.bmm(att, history)).mean(dim=1)  # [B, D]
        return (pooled * item).sum(-1, keepdim=True) + pooled.sum(1, keepdim=True)


SEQUENCE_3D = Case(
    "sequence_3d", Sequence3D, ("history",), (("history", Spec((4, D))), ("item", Spec()))
)

HAND_CASES: list[Case] = [
    USER_ITEM_MLP,
    VIEW_MERGE,
    VIEW_FROM_CANDIDATE_SIZE,
    BATCH_NORM_EVAL,
    BATCH_NORM_NO_STATS,
    DICT_FEATURES,
    SEQUENCE_3D,
]

# ------------------------------------------------------------------------------------------
# Zoo compilations, cached across test modules (compiling a zoo model takes about a second).

ZOO_NAMES = list(ZOO)
ZOO_EXAMPLE_COUNTS = (2, 3)


@functools.cache
def zoo_model(name: str) -> nn.Module:
    return ZOO[name].build(seed=0)


def zoo_example(name: str) -> dict:
    return ZOO[name].make_batch(list(ZOO_EXAMPLE_COUNTS), seed=100).replicated()


@functools.cache
def zoo_pipeline(name: str, options_key: tuple = ()):
    """``compile_graph`` of a zoo model; ``options_key`` is ``tuple(sorted(options.items()))``."""
    from rocs_compiler.pipeline import compile_graph

    entry = ZOO[name]
    return compile_graph(
        zoo_model(name),
        list(entry.request_inputs),
        (),
        zoo_example(name),
        rocs.Options(**dict(options_key)),
    )


@functools.cache
def zoo_compiled(name: str, options_key: tuple = ()):
    entry = ZOO[name]
    return rocs.compile(
        zoo_model(name),
        list(entry.request_inputs),
        example_kwargs=zoo_example(name),
        options=dict(options_key),
    )


def key(options: dict) -> tuple:
    return tuple(sorted(options.items()))
