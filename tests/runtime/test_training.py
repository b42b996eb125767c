"""Training through the compiled model (``rocs.compile(..., training=True)``).

Every zoo model, GLM and DCA conversions, and torch's history encoders: after ``loss.backward()``
through the compiled model every parameter's gradient equals eager's on the replicated batch, on
ragged batches (requests with 1, 3 and 17 impressions; one request; every impression its own
request), in the shared and the drop-in layout; and 50 SGD steps through the compiled model track
eager's losses. Each model is compiled once (module-scoped cache).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from training_testing import (
    RAGGED_BATCHES,
    assert_gradients_match,
    assert_losses_track,
    check_gradients,
    floating_leaves,
    gradients,
    optimizer_run,
)

import rocs_compiler as rocs
from models_zoo import ZOO, Batch, request_index
from models_zoo.history_encoders import Encoder, Recurrent, SelfAndTargetAttention

EXAMPLE_COUNTS = [2, 3]


def _train_mode(model: nn.Module) -> nn.Module:
    return model.train()


def _compile(model: nn.Module, request_inputs, make_batch, **kw):
    # No program choice: every call runs the training program, the subject of these tests (the
    # choice between it and the original model: test_training_choice.py).
    example = make_batch(EXAMPLE_COUNTS, seed=1).replicated()
    return rocs.compile(
        model, list(request_inputs), example_kwargs=example, training=True,
        options={"autotune": False}, **kw,
    )  # fmt: skip


# -- the zoo ------------------------------------------------------------------------------------


@functools.cache
def _zoo(name: str):
    entry = ZOO[name]
    model = _train_mode(entry.build(seed=0))
    return entry, model, _compile(model, entry.request_inputs, entry.make_batch)


@pytest.mark.parametrize("name", list(ZOO))
@pytest.mark.parametrize("batch_name", list(RAGGED_BATCHES))
def test_zoo_gradients_equal_eager(name, batch_name):
    entry, model, cm = _zoo(name)
    counts, shuffle = RAGGED_BATCHES[batch_name]
    batch = entry.make_batch(counts, seed=3, shuffle=shuffle)
    check_gradients(model, cm, batch, f"{name} {batch_name}")


# 100 training steps of the models with large dense-gradient tables or many layers take a minute
# or more on a loaded 2-core machine: run with ``-m slow`` (their gradients are checked above).
SLOW_RUNS = {"dlrm", "dcnv2", "finalmlp", "wukong", "target_attention"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_RUNS else n for n in ZOO]
)
def test_zoo_fifty_steps_track_eager(name):
    entry, model, cm = _zoo(name)
    batches = [
        entry.make_batch(c, seed=s, shuffle=True)
        for s, c in enumerate([[1, 3, 17], [4, 4], [2, 1, 1, 5]])
    ]
    eager_losses, compiled_losses = optimizer_run(model, cm, batches)
    assert_losses_track(eager_losses, compiled_losses, name)
    assert min(eager_losses[-3:]) < max(eager_losses[:3])  # the run trains at all


# -- GLM and DCA conversions ------------------------------------------------------------------------


@functools.cache
def _converted(name: str, transform: str):
    entry = ZOO[name]
    torch.manual_seed(1)
    if transform == "glm":
        model = rocs.apply_glm(entry.build(seed=0), entry.request_inputs)
    else:
        model = rocs.apply_dca(entry.build(seed=0), entry.request_inputs)
    model = _train_mode(model)
    return entry, model, _compile(model, entry.request_inputs, entry.make_batch)


CONVERSIONS = [
    ("dcnv2", "glm"),
    ("finalmlp", "glm"),
    ("wukong", "glm"),
    ("bst", "dca"),
    ("hstu", "dca"),
]


@pytest.mark.parametrize("name,transform", CONVERSIONS)
@pytest.mark.parametrize("batch_name", list(RAGGED_BATCHES))
def test_glm_and_dca_gradients_equal_eager(name, transform, batch_name):
    entry, model, cm = _converted(name, transform)
    counts, shuffle = RAGGED_BATCHES[batch_name]
    check_gradients(
        model, cm, entry.make_batch(counts, seed=4, shuffle=shuffle), f"{name} {transform}"
    )


def test_glm_training_through_the_compiled_model_equals_eager_training():
    """dcnv2's GLM conversion (with dropout 0.1 in training mode): three SGD steps through the
    compiled model give eager's weights, the mask parametrization (part of the graph) keeping
    every masked block at zero gradient; dropout draws what eager draws from the same seed."""
    entry, model, _ = _converted("dcnv2", "glm")
    eager_model = copy.deepcopy(model)
    trained = copy.deepcopy(model)
    cm = _compile(trained, entry.request_inputs, entry.make_batch)
    for m, call in (
        (eager_model, lambda b: eager_model(**b.replicated())),
        (trained, lambda b: cm(**b.kwargs, candidate_to_request=b.candidate_to_request)),
    ):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for seed in range(3):
            batch = entry.make_batch([1, 3, 17], seed=seed, shuffle=True)
            opt.zero_grad()
            torch.manual_seed(seed)
            (call(batch).float() ** 2).mean().backward()
            opt.step()
    for (name, a), b in zip(eager_model.named_parameters(), trained.parameters()):
        torch.testing.assert_close(
            b, a, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
    masks = [(n, p) for n, p in trained.named_buffers() if "mask" in n]
    assert masks, "the GLM conversion has masks"


# -- torch's history encoders -----------------------------------------------------------------------

D, L = 16, 5

ENCODERS = {
    "mha": lambda: SelfAndTargetAttention(),
    "mha_seq_first_key_padding": lambda: SelfAndTargetAttention(sequence_first=True, padding=True),
    "transformer_encoder": lambda: Encoder(),
    "transformer_encoder_seq_first_norm_first": lambda: Encoder(
        sequence_first=True, norm_first=True
    ),
    "gru": lambda: Recurrent(nn.GRU),
    "lstm_given_state": lambda: Recurrent(nn.LSTM, h0=True),
}


def _history_batch(counts, seed=0, shuffle=False) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    index = request_index(counts, shuffle=shuffle, generator=gen)
    hist = torch.randn(len(counts), L, D, generator=gen)
    c = torch.randn(index.shape[0], 8, generator=gen)
    return Batch({"hist": hist, "c": c}, index, ("hist",))


@functools.cache
def _encoder(name: str):
    torch.manual_seed(0)
    model = _train_mode(ENCODERS[name]())
    return model, _compile(model, ["hist"], _history_batch)


@pytest.mark.parametrize("name", list(ENCODERS))
@pytest.mark.parametrize("batch_name", list(RAGGED_BATCHES))
def test_history_encoder_gradients_equal_eager(name, batch_name):
    model, cm = _encoder(name)
    counts, shuffle = RAGGED_BATCHES[batch_name]
    check_gradients(model, cm, _history_batch(counts, seed=5, shuffle=shuffle), name)


@pytest.mark.parametrize(
    "name",
    [n if n in ("mha", "gru") else pytest.param(n, marks=pytest.mark.slow) for n in ENCODERS],
)
def test_history_encoder_fifty_steps_track_eager(name):
    model, cm = _encoder(name)
    batches = [_history_batch(c, seed=s, shuffle=True) for s, c in enumerate([[1, 3, 17], [4, 4]])]
    eager_losses, compiled_losses = optimizer_run(model, cm, batches)
    assert_losses_track(eager_losses, compiled_losses, name)


@pytest.mark.slow
@pytest.mark.parametrize("name,transform", CONVERSIONS)
def test_glm_and_dca_fifty_steps_track_eager(name, transform):
    entry, model, cm = _converted(name, transform)
    batches = [
        entry.make_batch(c, seed=s, shuffle=True) for s, c in enumerate([[1, 3, 17], [4, 4]])
    ]
    eager_losses, compiled_losses = optimizer_run(model, cm, batches)
    assert_losses_track(eager_losses, compiled_losses, f"{name} {transform}")


# -- the contract ---------------------------------------------------------------------------------


def _autograd_node_names(output: torch.Tensor) -> set[str]:
    seen, stack, names = set(), [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_the_training_program_calls_its_fused_ops_directly():
    """Each fused op of a training call is an autograd node of the op's own backward, reached
    without the dispatcher's custom-op wrappers (``RocsOp.run_with_backward``)."""
    entry, _, cm = _zoo("dlrm")
    batch = entry.make_batch([1, 3, 17], seed=3)
    out = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    names = _autograd_node_names(out)
    assert "_DirectAutogradBackward" in names, names
    assert not any(n.startswith("GeneratedBackwardFor_rocs") for n in names), names


def test_parameters_are_the_models_own_and_updates_are_seen():
    entry, model, cm = _zoo("two_tower")
    batch = entry.make_batch([1, 3, 17], seed=6, shuffle=True)
    first = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    sum(t.float().sum() for t in floating_leaves(first)).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    try:
        second = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
        want = model(**batch.replicated())
        for g, w in zip(floating_leaves(second), floating_leaves(want)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    finally:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(2.0)
        model.zero_grad(set_to_none=True)


def test_a_reassigned_parameter_is_followed():
    torch.manual_seed(0)
    model = _train_mode(SelfAndTargetAttention())
    cm = _compile(model, ["hist"], _history_batch)
    model.item = nn.Linear(8, D)  # a new module with new parameters
    batch = _history_batch([1, 3, 17], seed=7, shuffle=True)
    _, want = gradients(model, lambda: model(**batch.replicated()))
    _, got = gradients(
        model, lambda: cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    )
    assert_gradients_match(got, want, "reassigned item")


def test_request_inputs_requiring_grad():
    """Shared layout: a request row's gradient is the sum over its candidates (the eager
    gradient of the replicated rows, summed per request). Replicated layouts: refused."""
    model, cm = _encoder("mha")
    batch = _history_batch([1, 3, 17], seed=8, shuffle=True)
    hist = batch.kwargs["hist"].clone().requires_grad_()
    replicated = hist.detach().index_select(0, batch.candidate_to_request).requires_grad_()
    model(replicated, batch.kwargs["c"]).sum().backward()
    want = torch.zeros_like(hist).index_add_(0, batch.candidate_to_request, replicated.grad)
    cm(hist, batch.kwargs["c"], candidate_to_request=batch.candidate_to_request).sum().backward()
    torch.testing.assert_close(hist.grad, want, rtol=1e-4, atol=1e-5)
    model.zero_grad(set_to_none=True)
    with pytest.raises(rocs.InputError, match="shared"):
        cm(replicated, batch.kwargs["c"])


def test_no_grad_calls_still_work():
    entry, model, cm = _zoo("dlrm")
    batch = entry.make_batch([1, 3, 17], seed=6, shuffle=True)
    with torch.no_grad():
        want = model(**batch.replicated())
        for _ in range(13):  # through the program choice's trials
            got = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_training_compile_keeps_the_models_mode_and_random_state():
    torch.manual_seed(0)
    model = _train_mode(SelfAndTargetAttention())
    state = torch.random.get_rng_state()
    _compile(model, ["hist"], _history_batch)
    assert model.training and all(m.training for m in model.modules())
    assert torch.equal(torch.random.get_rng_state(), state)


def test_inference_compile_still_refuses_training_mode():
    model = _train_mode(SelfAndTargetAttention())
    example = _history_batch(EXAMPLE_COUNTS).replicated()
    with pytest.raises(rocs.InputError, match="training=True"):
        rocs.compile(model, ["hist"], example_kwargs=example)


def test_training_with_eager_fallback_is_refused():
    model = _train_mode(SelfAndTargetAttention())
    with pytest.raises(ValueError, match="fallback"):
        _compile(model, ["hist"], _history_batch, fallback="eager")


# -- train-mode semantics: randomness and batch statistics -------------------------------------------


class _RequestSide(nn.Module):
    """A request tower with dropout or batch norm on its request-only values, scored against the
    candidate."""

    def __init__(self, kind: str):
        super().__init__()
        self.user = nn.Linear(D, D)
        self.mix = {"dropout": nn.Dropout(0.5), "batch_norm": nn.BatchNorm1d(D)}[kind]
        self.out = nn.Linear(D, D)
        self.item = nn.Linear(8, D)

    def forward(self, hist, c):
        u = self.out(torch.relu(self.mix(self.user(hist.mean(1)))))
        return (u * self.item(c)).sum(-1)


@pytest.mark.parametrize("kind", ["dropout", "batch_norm"])
def test_row_mixing_and_random_request_ops_run_per_impression_and_are_reported(kind):
    torch.manual_seed(0)
    model = _train_mode(_RequestSide(kind))
    cm = _compile(model, ["hist"], _history_batch)
    reasons = " ".join(f.reason for f in cm.report().fallbacks)
    assert {"dropout": "random", "batch_norm": "batch"}[kind] in reasons
    eager_model = copy.deepcopy(model)
    # Not one request for batch norm: over identical rows its variance is rounding residue,
    # which it divides by sqrt(eps), in eager as compiled (docs/contract.md, numerical contract).
    for counts in ([1, 3, 17], [1, 1, 1, 1]) + (([5],) if kind == "dropout" else ()):
        batch = _history_batch(counts, seed=len(counts), shuffle=True)
        _, want = gradients(eager_model, lambda batch=batch: eager_model(**batch.replicated()))
        _, got = gradients(
            model,
            lambda batch=batch: cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request),
        )
        assert_gradients_match(got, want, kind)
    for (name, a), b in zip(eager_model.named_buffers(), model.buffers()):
        torch.testing.assert_close(
            b, a, msg=lambda m, name=name: f"{name}: {m}"
        )  # running statistics


def test_request_dropout_draws_once_per_impression():
    """The default keeps eager's distribution: impressions of one request see independent
    dropout masks (the value is broadcast before the random op)."""
    torch.manual_seed(0)
    model = _train_mode(_RequestSide("dropout"))
    model.out = nn.Identity()
    model.item = nn.Identity()
    model.forward = lambda hist, c: torch.relu(model.mix(model.user(hist.mean(1)))) + 0 * c[:, :1]
    cm = _compile(
        model, ["hist"], lambda counts, seed=0, shuffle=False: _history_batch(counts, seed, shuffle)
    )
    batch = _history_batch([64], seed=1)
    out = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    distinct = {tuple((row != 0).tolist()) for row in out}
    assert len(distinct) > 32


class _DroppedRequest(nn.Module):
    """The request tower's values after dropout, next to the candidate's: ``[N, 2 * D]``."""

    def __init__(self):
        super().__init__()
        self.user = nn.Linear(D, D)
        self.drop = nn.Dropout(0.5)
        self.item = nn.Linear(8, D)

    def forward(self, hist, c):
        return torch.cat([self.drop(self.user(hist.mean(1))), self.item(c)], -1)


class _DroppedConcat(_DroppedRequest):
    """One dropout over the concatenation of the request's and the candidate's values."""

    def forward(self, hist, c):
        return self.drop(torch.cat([self.user(hist.mean(1)), self.item(c)], -1))


def _assert_one_mask_per_request(model, out, batch):
    """``out``'s request half is each request's tower output under one dropout mask shared by
    its impressions (kept values scaled by 1 / (1 - p)); and its gradients are those of the
    model with that mask fixed (and with the candidate half's, where that is dropped too)."""
    hist, c, index = batch.kwargs["hist"], batch.kwargs["c"], batch.candidate_to_request
    dropped = out[:, :D]
    kept = dropped != 0
    item = model.item(c)
    if isinstance(model, _DroppedConcat):
        kept_items = out[:, D:] != 0
        assert len({tuple(row.tolist()) for row in kept_items}) > index.shape[0] // 2
        item = 2 * item * kept_items
    masks = set()
    for r in range(hist.shape[0]):
        rows = kept[index == r]
        assert (rows == rows[0]).all(), f"request {r}: its impressions drew different masks"
        masks.add(tuple(rows[0].tolist()))
    assert len(masks) > 1, "every request drew the same mask"
    tower = model.user(hist.mean(1)).index_select(0, index)
    torch.testing.assert_close(dropped[kept], 2 * tower[kept])
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    got = torch.autograd.grad((out * weights).sum(), list(model.parameters()))
    fixed_mask = torch.cat([2 * tower * kept, item], -1)
    want = torch.autograd.grad((fixed_mask * weights).sum(), list(model.parameters()))
    for (name, _), g, w in zip(model.named_parameters(), got, want):
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("module", [_DroppedRequest, _DroppedConcat])
def test_per_request_dropout_draws_one_mask_per_request(module):
    """``request_dropout="per_request"``: the dropout on request-side values runs once per
    request (a change of the model, asked for), in the shared and the drop-in layout, and on
    every call: the training choice never runs the original model, which draws per impression.
    A dropout over request and candidate values together is split: its candidate part still
    draws per impression."""
    torch.manual_seed(0)
    model = _train_mode(module())
    example = _history_batch(EXAMPLE_COUNTS, seed=1).replicated()
    cm = rocs.compile(
        model, ["hist"], example_kwargs=example, training=True,
        options={"request_dropout": "per_request"},
    )  # fmt: skip
    assert not cm.report().fallbacks
    for call in range(22):  # past the choice's trials (2 x TRAINING_TRIALS calls per bucket)
        batch = _history_batch([1, 3, 17, 4], seed=call, shuffle=True)
        out = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
        _assert_one_mask_per_request(model, out, batch)
    batch = _history_batch([2, 5, 1], seed=99)
    out = cm(**batch.replicated())  # drop-in: the requests are found, then masked once each
    _assert_one_mask_per_request(model, out, batch)


def test_request_dropout_takes_only_its_two_values():
    model = _train_mode(_DroppedRequest())
    with pytest.raises(rocs.OptionsError, match=r"rocs.compile.*'per_impression', 'per_request'"):
        rocs.compile(
            model, ["hist"], example_kwargs=_history_batch([2], seed=1).replicated(),
            training=True, options={"request_dropout": "per_user"},
        )  # fmt: skip


def test_batch_norm_running_statistics_are_left_alone_by_compiling():
    torch.manual_seed(0)
    model = _train_mode(_RequestSide("batch_norm"))
    before = {n: b.clone() for n, b in model.named_buffers()}
    _compile(model, ["hist"], _history_batch)
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n


# -- one gradient per shared table -------------------------------------------------------------------


class _SharedTable(nn.Module):
    """One item table read four ways: the request's history (padding id 0) and a mean bag of
    it, the candidate's item, and a tied output projection (not a lookup)."""

    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(50, D, padding_idx=0)
        self.mix = nn.Linear(3 * D, D)

    def forward(self, hist_ids, item):
        history = self.items(hist_ids).sum(1)
        bag = nn.functional.embedding_bag(hist_ids, self.items.weight, mode="mean", padding_idx=0)
        target = self.items(item)
        user = self.mix(torch.cat([history, bag, target], -1))
        return {"score": (user * target).sum(-1), "logits": user @ self.items.weight.t()}


def _shared_table_batch(counts, seed=0, shuffle=False) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    index = request_index(counts, shuffle=shuffle, generator=gen)
    hist = torch.randint(0, 50, (len(counts), 6), generator=gen)
    hist[0, 3:] = 0  # padding
    item = torch.randint(1, 50, (index.shape[0],), generator=gen)
    item[0] = hist[0, 0]  # a table row read by the history and a candidate
    return Batch({"hist_ids": hist, "item": item}, index, ("hist_ids",))


def test_a_table_read_by_several_lookups_gets_one_gradient_buffer():
    """The training program reads the table's three lookups in one node whose backward adds
    every lookup's rows into one zero buffer (``runtime/training/table_gradients.py``): the gradients
    are eager's (padded history entries add nothing; the tied projection keeps its own)."""
    from rocs_compiler.runtime.training.table_gradients import TableLookups

    torch.manual_seed(0)
    model = _train_mode(_SharedTable())
    cm = _compile(model, ["hist_ids"], _shared_table_batch)
    nodes = cm._training.graph_module.graph.nodes
    merged = [n for n in nodes if isinstance(n.target, TableLookups)]
    assert len(merged) == 1 and len(merged[0].target.lookups) == 3, merged
    for batch_name, (counts, shuffle) in RAGGED_BATCHES.items():
        batch = _shared_table_batch(counts, seed=len(counts), shuffle=shuffle)
        check_gradients(model, cm, batch, f"shared table {batch_name}")


# -- the torch.compile backend ---------------------------------------------------------------------


def test_the_backend_refuses_training_naming_rocs_compile():
    with pytest.raises(rocs.OptionsError, match=r"rocs.compile\(.*training=True"):
        rocs.backend(request_inputs=["hist"], training=True)


def test_backward_through_the_backend_names_the_training_compile(monkeypatch):
    from rocs_compiler.backend import graph_compiler

    monkeypatch.setattr(graph_compiler, "_GRAD_WARNED", False)  # warned once per process
    torch.manual_seed(0)
    model = _train_mode(SelfAndTargetAttention())
    compiled = torch.compile(model, backend=rocs.backend(request_inputs=["hist"], inductor=False))
    batch = _history_batch([2, 3], seed=2)
    with pytest.warns(UserWarning, match="training=True"):
        out = compiled(**batch.replicated())
    with pytest.raises(RuntimeError, match=r"rocs.compile\(\.\.\., training=True\)"):
        out.sum().backward()


@pytest.mark.parametrize("layout", ["shared", "dropin"])
def test_an_empty_batch_backpropagates_zero_gradients(layout):
    """A call without candidates (a rank whose data loader ran dry): the table lookups'
    gradients reshape zero rows, which must not be ambiguous."""
    entry = ZOO["din"]
    model = entry.build().eval()
    cm = rocs.compile(
        model, list(entry.request_inputs), example_kwargs=entry.make_batch([4, 3]).replicated(),
        training=True,
    )  # fmt: skip
    batch = entry.make_batch([2, 3])
    if layout == "shared":
        kwargs = {n: v[:0] for n, v in batch.kwargs.items()}
        out = cm(**kwargs, candidate_to_request=torch.zeros(0, dtype=torch.int64))
    else:
        out = cm(**{n: v[:0] for n, v in batch.replicated().items()})
    assert out.shape == (0,)
    out.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(not g.any() for g in grads)
