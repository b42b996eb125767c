"""Every input format behind one compiled-model class, with one contract for both programs.

The program choice runs the shared program and, on alternate trials, a plain one (the captured
graph unshared, or the original model where a format offers it); every layout is therefore called
more times than the choice needs to try both (``CALLS``), under ``no_grad`` where it runs, and
every call must equal the original model on the replicated batch or raise the contract's errors.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import rocs_compiler as rocs
from rocs_compiler.errors import CompileError, InputError
from rocs_compiler.kernels.index_contract import IndexRangeError
from rocs_compiler.runtime.choice.program_choice import TRIALS

CALLS = 2 * TRIALS + 2


class _UserTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.user, self.head = nn.Linear(8, 8), nn.Linear(16, 1)

    def forward(self, u, c):
        return self.head(torch.cat([torch.relu(self.user(u)), c], -1)).squeeze(-1)


class _Packed(nn.Module):
    """Request features as columns 0:4 of ``X``, beside a request-side argument ``text``."""

    def __init__(self):
        super().__init__()
        self.user, self.text, self.head = nn.Linear(4, 8), nn.Linear(3, 8), nn.Linear(16, 1)

    def forward(self, X, text):
        user = torch.relu(self.user(X[:, 0:4])) + self.text(text)
        return self.head(torch.cat([user, X[:, 4:8], X[:, 8:12]], -1)).squeeze(-1)


def _packed_batch(counts, seed=0):
    g = torch.Generator().manual_seed(seed)
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    users = torch.randn(len(counts), 4, generator=g)
    text = torch.randn(len(counts), 3, generator=g)
    X = torch.randn(int(index.shape[0]), 12, generator=g)
    X[:, 0:4] = users.index_select(0, index)
    return X, text, index


def test_every_format_compiles_to_one_class():
    u, c = torch.randn(2, 8)[[0, 0, 1]], torch.randn(3, 8)
    plain = rocs.compile(_UserTower().eval(), ["u"], example_kwargs=dict(u=u, c=c))
    X, text, index = _packed_batch([2, 1])
    packed = rocs.compile(
        _Packed().eval(), ["X[:, 0:4]", "text"], example_inputs=(X, text[index])
    )
    assert type(plain) is type(packed) is rocs.CompiledModel
    assert plain.input_format.name == "tensors" and packed.input_format.name == "column ranges"
    assert packed.program_choices() == {}  # documented for every compiled model


def test_column_ranges_beside_a_request_argument_take_the_shared_layout():
    model = _Packed().eval()
    X, text, index = _packed_batch([2, 1, 3])
    cm = rocs.compile(model, ["X[:, 0:4]", "text"], example_inputs=(X, text[index]))
    with torch.no_grad():
        for counts in ([3, 1, 4], [1], [2, 2]):
            X, text, index = _packed_batch(counts, seed=len(counts))
            want = model(X, text.index_select(0, index))
            for _ in range(CALLS):
                got = cm(X, text, candidate_to_request=index)  # text: one row per request
                torch.testing.assert_close(got, want)
            torch.testing.assert_close(cm(X, text.index_select(0, index)), want)
    assert any(key[0] == "shared" for key in cm.program_choices())


def test_packed_request_columns_that_vary_within_a_request_are_refused():
    model = _Packed().eval()
    X, text, index = _packed_batch([2, 1])
    cm = rocs.compile(model, ["X[:, 0:4]", "text"], example_inputs=(X, text[index]))
    X[1, 0] += 1.0  # candidate 1 belongs to request 0, as candidate 0
    with torch.no_grad(), pytest.raises(InputError, match="varies within a request"):
        cm(X, text, candidate_to_request=index)


def test_call_replicated_takes_a_request_without_candidates():
    model = _UserTower().eval()
    u, c = torch.randn(2, 8)[[0, 0, 1]], torch.randn(3, 8)
    cm = rocs.compile(model, ["u"], example_kwargs=dict(u=u, c=c))
    none = torch.zeros(0, dtype=torch.long)
    with torch.no_grad():
        out = cm.call_replicated(u=u[:0], c=c[:0], candidate_to_request=none)
    assert out.shape == (0,)


def test_meta_inputs_are_an_input_error():
    model = _UserTower().eval()
    u, c = torch.randn(2, 8)[[0, 0, 1]], torch.randn(3, 8)
    cm = rocs.compile(model, ["u"], example_kwargs=dict(u=u, c=c))
    with torch.no_grad(), pytest.raises(InputError, match="meta"):
        cm(u=u.to("meta"), c=c.to("meta"))


# -- KeyedJaggedTensor keys -----------------------------------------------------------------------

torchrec_zoo = pytest.importorskip("models_zoo.torchrec_models", reason="needs torchrec")


def _dlrm(request_extra=()):
    model, request, _ = torchrec_zoo.build("dlrm")
    example = torchrec_zoo.draw([2, 1, 3], seed=0)
    compiled = rocs.compile(
        model, request + list(request_extra), example_inputs=(example.dense, example.kjt)
    )
    return model, compiled


@pytest.mark.parametrize("counts", [[3, 1, 2], [1, 1, 1]], ids=["R!=N", "R==N"])
def test_dense_request_input_beside_kjt_keys_in_the_shared_layout(counts):
    """The original model, tried as the plain program, gets the dense request rows gathered to
    the candidates (it used to get R rows: wrong scores at R == N, a crash otherwise)."""
    model, cm = _dlrm(["dense_features"])
    batch = torchrec_zoo.draw(counts, seed=3)
    dense = torch.randn(len(counts), torchrec_zoo.DENSE)
    with torch.no_grad():
        want = model(dense.index_select(0, batch.index), batch.kjt)
        for _ in range(CALLS):
            torch.testing.assert_close(cm(dense, batch.shared, candidate_to_request=batch.index), want)
            torch.testing.assert_close(cm(dense, batch.shared), want)  # inverse indices
    assert {key[0] for key in cm.program_choices()} == {"shared-original"}


def test_out_of_range_inverse_indices_raise_the_index_error_on_every_program():
    model, cm = _dlrm()
    batch = torchrec_zoo.draw([3, 1, 2], seed=3)
    keys, rows = batch.shared.inverse_indices()
    rows = rows.clone()
    request_rows = [i for i, k in enumerate(keys) if k in torchrec_zoo.REQUEST_KEYS]
    rows[request_rows, 0] = 7  # every request key agrees on an out-of-range row
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    shared = batch.shared
    bad = KeyedJaggedTensor(
        keys=shared.keys(), values=shared.values(), lengths=shared.lengths(),
        stride_per_key_per_rank=shared.stride_per_key_per_rank(), inverse_indices=(keys, rows),
    )  # fmt: skip
    with torch.no_grad():
        for _ in range(CALLS):
            with pytest.raises(IndexRangeError):
                cm(batch.dense, bad)


def test_shared_kjt_refuses_a_wrong_index_and_swapped_kjts():
    from rocs_compiler.integrations import torchrec as rocs_torchrec
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    users = KeyedJaggedTensor.from_lengths_sync(
        keys=["user_id"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1])
    )
    items = KeyedJaggedTensor.from_lengths_sync(
        keys=["item_id"], values=torch.tensor([3, 4, 5]), lengths=torch.tensor([1, 1, 1])
    )
    index = torch.tensor([0, 0, 1])
    assert rocs_torchrec.shared_kjt(users, items, index).inverse_indices()[1].shape == (2, 3)
    with pytest.raises(ValueError, match="3 rows"):
        rocs_torchrec.shared_kjt(users, items, index[:2])
    with pytest.raises(ValueError, match="request KJT first"):
        rocs_torchrec.shared_kjt(items, users, index)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        rocs_torchrec.shared_kjt(users, items, torch.tensor([0, 2, 1]))


class _ReadsKJTByKey(nn.Module):
    """Looks up through an EmbeddingBagCollection, and also reads a key of the KJT directly."""

    def __init__(self):
        super().__init__()
        self.tables = torchrec_zoo.collection()
        self.head = nn.LazyLinear(1)

    def forward(self, dense_features, sparse_features):
        pooled = self.tables(sparse_features).values()
        history_length = sparse_features["history"].lengths().float().unsqueeze(1)
        return self.head(torch.cat([dense_features, pooled, history_length], 1)).squeeze(-1)


def test_a_kjt_read_by_key_is_a_compile_error_or_runs_eagerly():
    model = _ReadsKJTByKey()
    example = torchrec_zoo.draw([2, 1, 3], seed=0)
    with torch.no_grad():
        model(example.dense, example.kjt)  # materialize the lazy layer
    model.eval()
    with pytest.raises(CompileError, match="by key"):
        rocs.compile(model, torchrec_zoo.REQUEST, example_inputs=(example.dense, example.kjt))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = rocs.compile(
            model, torchrec_zoo.REQUEST, example_inputs=(example.dense, example.kjt),
            fallback="eager",
        )  # fmt: skip
        batch = torchrec_zoo.draw([3, 1, 2], seed=4)
        with torch.no_grad():
            want = model(batch.dense, batch.kjt)
            torch.testing.assert_close(cm(batch.dense, batch.kjt), want)
            torch.testing.assert_close(
                cm(batch.dense, batch.shared, candidate_to_request=batch.index), want
            )
    assert cm.is_fallback and "by key" in cm.report().note


class _WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 1)

    def forward(self, X):
        X[:, 0:4] = X[:, 0:4] * 2.0
        return self.head(X).squeeze(-1)


def test_a_forward_writing_into_its_packed_input_is_refused():
    X = torch.randn(3, 8)
    X[1, 0:4] = X[0, 0:4]
    before = X.clone()
    with pytest.raises(CompileError, match="writes into its input 'X'"):
        rocs.compile(_WritesItsInput().eval(), ["X[:, 0:4]"], example_inputs=(X,))
    assert torch.equal(X, before)  # the example itself is left as it was


class _WideAndDeep(nn.Module):
    """A packed tensor inside a dict argument, as tabular libraries pass their inputs."""

    def __init__(self):
        super().__init__()
        self.user, self.wide, self.head = nn.Linear(4, 8), nn.Linear(3, 1), nn.Linear(16, 1)

    def forward(self, X):
        tab = X["deeptabular"]
        deep = torch.cat([torch.relu(self.user(tab[:, 0:4])), tab[:, 4:12]], -1)
        return (self.head(deep) + self.wide(X["wide"])).squeeze(-1)


def test_a_packed_tensor_inside_a_dict_is_named_by_key_then_columns():
    model = _WideAndDeep().eval()

    def batch(counts, seed):
        X, _, index = _packed_batch(counts, seed)
        return {"wide": torch.randn(X.shape[0], 3, generator=torch.Generator().manual_seed(seed)),
                "deeptabular": X}, index

    example, _ = batch([2, 1], 0)
    cm = rocs.compile(model, ["X.deeptabular[:, 0:4]"], example_inputs=(example,))
    assert cm.report().request_flops > 0
    with torch.no_grad():
        for counts in ([3, 1, 2], [1]):
            X, index = batch(counts, len(counts))
            want = model(X)
            for _ in range(CALLS):
                torch.testing.assert_close(cm(X), want)
                torch.testing.assert_close(cm(X, candidate_to_request=index), want)
    with pytest.raises(InputError, match="arg.key"):
        rocs.compile(model, ["X.nothing[:, 0:4]"], example_inputs=(example,))
