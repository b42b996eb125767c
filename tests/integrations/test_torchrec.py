"""TorchRec models, whose request features are keys of a ``KeyedJaggedTensor``.

Each model (``models_zoo/torchrec_models.py``: TorchRec's own DLRM, DLRM_DCN, DLRM_Projection,
the experimental transformer DLRM and SimpleDeepFMNN) is compiled with the user's keys named
``"sparse_features[user_id]"`` and compared with eager on ragged batches (requests with different
candidate counts and histories of different lengths, an empty one included) in every call
layout. The report's request FLOPs are checked against a count derived by hand from the
architecture, and the request keys' lookups against the nodes that run per request.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import rocs_compiler as rocs

pytest.importorskip(
    "torchrec", reason="TorchRec models need torchrec (see the README's test command)"
)
from models_zoo import torchrec_models as zoo
from rocs_compiler.integrations import torchrec as rocs_torchrec
from rocs_compiler.formats.kjt import KJTSplit
from rocs_compiler.runtime.rows.request_detection import detect_requests


def _compile(model, request=zoo.REQUEST, weighted=False, **kwargs):
    example = zoo.draw([2, 1, 3], seed=0, weighted=weighted)
    return rocs.compile(model, request, example_inputs=(example.dense, example.kjt), **kwargs)


def _check_layouts(model, compiled, batch, pooled=True):
    """Drop-in, shared layout, and replicated rows with the grouping given: all equal eager."""
    with torch.no_grad():
        want = model(batch.dense, batch.kjt)
        if pooled:
            # TorchRec's EmbeddingBagCollection reads the shared KJT through its inverse
            # indices (its EmbeddingCollection does not): the same scores.
            torch.testing.assert_close(model(batch.dense, batch.shared), want)
        calls = {
            "drop-in": compiled(batch.dense, batch.kjt),
            "shared": compiled(batch.dense, batch.shared, candidate_to_request=batch.index),
            # The grouping read from the KJT's inverse indices, as TorchRec's modules read it.
            "shared, inverse indices": compiled(batch.dense, batch.shared),
            "indexed": compiled(batch.dense, batch.kjt, candidate_to_request=batch.index),
        }
    for layout, got in calls.items():
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=layout)


@pytest.mark.parametrize("name", zoo.MODELS)
def test_torchrec_model_with_request_keys(name):
    model, request, request_flops = zoo.build(name)
    compiled = _compile(model, request)
    _check_layouts(model, compiled, zoo.draw([3, 1, 5, 2], seed=1, histories=[2, 0, 5, 1]))
    _check_layouts(model, compiled, zoo.draw([4], seed=2))
    report = compiled.report(candidates=64)
    assert not report.fallbacks, report.fallbacks
    assert report.request_flops == request_flops
    # Each request key is looked up once per request; the candidate keys once per candidate.
    lookups = [n for n in report.nodes if n.op == "aten.embedding.default"]
    assert sorted(n.role for n in lookups) == ["CANDIDATE"] * 2 + ["REQUEST"] * 2


def test_user_dense_features_and_keys_together():
    """``dense_features`` named too (the user's dense context): the dense arch, the request
    block of the interaction and the over arch's share of the dense embedding and of the request
    block's dots run per request."""
    model, request, _ = zoo.build("dlrm")
    compiled = _compile(model, request + ["dense_features"])
    batch = zoo.draw([3, 1, 2], seed=3)
    dense = torch.randn(3, zoo.DENSE)
    batch.dense = dense[batch.index]
    with torch.no_grad():
        want = model(batch.dense, batch.kjt)
        torch.testing.assert_close(compiled(batch.dense, batch.kjt), want)
        shared = compiled(dense, batch.shared, candidate_to_request=batch.index)
        torch.testing.assert_close(shared, want)
    dense_arch = 2 * (zoo.DENSE * 16 + 16 * zoo.D)
    block = 2 * (zoo.K + 1) ** 2 * zoo.D  # [dense, user_id, history] pairwise dots
    # The over arch's first layer: the dense embedding's columns and the K (K + 1) / 2 dots
    # among [dense, user_id, history] the interaction keeps.
    over = 2 * zoo.D * 16 + 2 * ((zoo.K + 1) * zoo.K // 2) * 16
    report = compiled.report(candidates=64)
    assert report.request_flops == dense_arch + block + over


def test_weighted_keys():
    model, request, request_flops = zoo.build("dlrm", weighted=True)
    compiled = _compile(model, request, weighted=True)
    _check_layouts(model, compiled, zoo.draw([2, 3, 1], seed=4, weighted=True))
    assert compiled.report().request_flops == request_flops


def test_batches_whose_histories_are_all_empty():
    model, request, _ = zoo.build("deepfm")
    compiled = _compile(model, request)
    _check_layouts(model, compiled, zoo.draw([2, 1, 3], seed=5, histories=[0, 0, 0]))
    _check_layouts(model, compiled, zoo.draw([1], seed=6, histories=[0]))


def test_drop_in_requests_are_runs_of_equal_jagged_rows():
    """The padded rows of the request keys are equal exactly where the jagged rows are: a
    history ``[a, b]`` and ``[a, b, 0]`` (a real id 0) differ by their lengths."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    history = [[3, 4], [3, 4], [3, 4, 0], [3, 4, 0], [], [3, 4]]
    kjt = KeyedJaggedTensor(
        keys=["history", "item_id"],
        values=torch.tensor([v for row in history for v in row] + list(range(6))),
        lengths=torch.tensor([len(row) for row in history] + [1] * 6),
    )
    split = KJTSplit("sparse_features", ("history", "item_id"), frozenset({"history"}), False)
    pieces = split.pieces(kjt)["history"]
    assert pieces["ids"].shape == (6, 3)
    found = detect_requests([pieces["ids"], pieces["lengths"]], 6)
    assert found.counts == [2, 2, 1, 1]


def test_a_request_that_differs_within_a_run_is_two_requests_and_exact():
    model, request, _ = zoo.build("dlrm")
    compiled = _compile(model, request)
    batch = zoo.draw([3, 3], seed=7, histories=[2, 2])
    values = batch.kjt.values().clone()
    first = 6 + 2 * 1  # after the 6 user ids: candidate 1's history, its first id
    values[first] = (values[first] + 1) % zoo.VOCAB["item_id"]
    kjt = type(batch.kjt)(keys=batch.kjt.keys(), values=values, lengths=batch.kjt.lengths())
    with torch.no_grad():
        torch.testing.assert_close(compiled(batch.dense, kjt), model(batch.dense, kjt))
        with pytest.raises(rocs.InputError, match="varies within a request"):
            compiled(batch.dense, kjt, candidate_to_request=batch.index)


def test_names_and_calls_are_checked():
    model, _, _ = zoo.build("dlrm")
    example = zoo.draw([2, 1], seed=0)
    args = (example.dense, example.kjt)
    keys = r"sparse_features\[user_id\], sparse_features\[history\], sparse_features\[item_id\]"
    with pytest.raises(rocs.InputError, match=f"unknown key 'age'.*its keys are: {keys}"):
        rocs.compile(model, ["sparse_features[age]"], example_inputs=args)
    with pytest.raises(rocs.InputError, match=f"'sparse_features\\[user_id\\]'.*{keys}"):
        rocs.compile(model, ["user_id"], example_inputs=args)
    with pytest.raises(rocs.InputError, match=r"did you mean 'sparse_features\[history\]'"):
        rocs.compile(model, ["sparse_features.history"], example_inputs=args)
    compiled = rocs.compile(model, ['sparse_features["user_id"]', "sparse_features[history]"],
                            example_inputs=args)  # fmt: skip
    batch = zoo.draw([2, 2], seed=8)
    request = _keys(batch.shared, list(zoo.REQUEST_KEYS))
    candidates = _keys(batch.shared, list(zoo.CANDIDATE_KEYS))
    without_inverse = rocs_torchrec.shared_kjt(request, candidates)
    with pytest.raises(rocs.InputError, match="shared layout, which needs candidate_to_request"):
        compiled(batch.dense, without_inverse)
    scrambled = rocs_torchrec.shared_kjt(request, candidates, batch.index)
    scrambled.inverse_indices()[1][2] = scrambled.inverse_indices()[1][2].flip(0)
    with pytest.raises(rocs.InputError, match="candidate key 'item_id' has inverse indices"):
        compiled(batch.dense, scrambled)
    with pytest.raises(rocs.InputError, match="candidate keys need one row per candidate"):
        compiled(batch.dense, batch.shared, candidate_to_request=batch.index[:3])
    with pytest.raises(rocs.InputError, match="compiled for"):
        compiled(
            batch.dense,
            rocs_torchrec.shared_kjt(_keys(batch.kjt, ["user_id"]), _keys(batch.kjt, ["item_id"])),
        )


def _keys(kjt, keys):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    parts = kjt.to_dict()
    return KeyedJaggedTensor.from_jt_dict({k: parts[k] for k in keys})


def test_all_keys_of_an_argument_by_its_name():
    model, _, _ = zoo.build("dlrm")
    compiled = _compile(model, ["sparse_features"])
    assert compiled.input_format.splits[0].request == frozenset(zoo.REQUEST_KEYS + zoo.CANDIDATE_KEYS)
    batch = zoo.draw([2, 2], seed=9)
    with torch.no_grad():
        torch.testing.assert_close(compiled(batch.dense, batch.kjt), model(batch.dense, batch.kjt))


def test_weight_updates_of_the_tables_are_seen():
    model, request, _ = zoo.build("dlrm")
    compiled = _compile(model, request)
    batch = zoo.draw([2, 3], seed=10)
    with torch.no_grad():
        model.sparse_arch.embedding_bag_collection.embedding_bags["t_user"].weight.mul_(2)
        torch.testing.assert_close(compiled(batch.dense, batch.kjt), model(batch.dense, batch.kjt))


class _Regrouped(nn.Module):
    """The user's and the item's pooled embeddings regrouped by key
    (``KeyedTensor.regroup``, fbgemm's ``permute_pooled_embs``), a user tower on the first."""

    def __init__(self):
        super().__init__()
        self.ebc = zoo.collection()
        self.user = nn.Linear(2 * zoo.D, 8)
        self.out = nn.Linear(8 + 2 * zoo.D + zoo.DENSE, 1)

    def forward(self, dense_features, sparse_features):
        from torchrec.sparse.jagged_tensor import KeyedTensor

        pooled = self.ebc(sparse_features)
        user, item = KeyedTensor.regroup(
            [pooled], [list(zoo.REQUEST_KEYS), list(zoo.CANDIDATE_KEYS)]
        )
        return self.out(torch.cat([torch.relu(self.user(user)), item, dense_features], 1))


def test_keyed_tensor_regroup():
    model = _Regrouped().eval()
    compiled = _compile(model)
    _check_layouts(model, compiled, zoo.draw([3, 1, 2], seed=15))
    # The user tower (2 D -> 8) and the output layer's share of its 8 columns, per request.
    assert compiled.report().request_flops == 2 * (2 * zoo.D) * 8 + 2 * 8 * 1


class _ReadsValues(nn.Module):
    """Reads the KJT's values directly, beside an EmbeddingBagCollection."""

    def __init__(self):
        super().__init__()
        self.ebc = zoo.collection()
        self.out = nn.Linear(3 * zoo.D + 1, 1)

    def forward(self, dense_features, sparse_features):
        pooled = self.ebc(sparse_features).values()
        count = sparse_features.lengths().float().sum().expand(pooled.shape[0], 1)
        return self.out(torch.cat([pooled[:, : 3 * zoo.D], count], 1))


def test_a_model_reading_the_kjt_otherwise_is_refused_or_runs_eagerly():
    model = _ReadsValues().eval()
    with pytest.raises(rocs.CompileError, match=r"other than through an EmbeddingBagCollection"):
        _compile(model)
    with pytest.warns(UserWarning, match="will run eagerly"):
        compiled = _compile(model, fallback="eager")
    assert compiled.is_fallback and "EmbeddingBagCollection" in compiled.report().note
    batch = zoo.draw([2, 3], seed=11)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model(batch.dense, batch.kjt)
        torch.testing.assert_close(compiled(batch.dense, batch.kjt), want)
        shared = compiled(batch.dense, batch.shared, candidate_to_request=batch.index)
        torch.testing.assert_close(shared, want)


def test_unpooled_lookups_read_as_padded_rows():
    """``EmbeddingCollection`` + ``to_padded_dense(desired_length)``: a per-position layer over
    the history runs once per request."""
    torch.manual_seed(0)
    model = zoo.HistorySequence().eval()
    compiled = _compile(model)
    _check_layouts(model, compiled, zoo.draw([3, 1, 2], seed=16, histories=[5, 0, 3]), False)
    _check_layouts(model, compiled, zoo.draw([2, 2], seed=17, histories=[0, 0]), False)
    report = compiled.report()
    assert not report.fallbacks, report.fallbacks
    assert report.request_flops == zoo.SEQUENCE_REQUEST_FLOPS


class _Unpooled(nn.Module):
    """The history's unpooled embeddings as the model's output, read one of three ways."""

    def __init__(self, read):
        super().__init__()
        from torchrec.modules.embedding_configs import EmbeddingConfig
        from torchrec.modules.embedding_modules import EmbeddingCollection

        keys = list(zoo.REQUEST_KEYS + zoo.CANDIDATE_KEYS)
        table = EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=30, feature_names=keys)
        self.ec = EmbeddingCollection(tables=[table])
        self.read = read

    def forward(self, dense_features, sparse_features):
        history = self.ec(sparse_features)["history"]
        return self.read(history).flatten(1) + dense_features.sum(1, keepdim=True)


def test_unpooled_rows_are_truncated_and_padded_as_torchrec_does():
    model = _Unpooled(lambda jt: jt.to_padded_dense(desired_length=3, padding_value=-1.0)).eval()
    compiled = _compile(model)
    _check_layouts(model, compiled, zoo.draw([2, 1, 3], seed=18, histories=[5, 0, 2]), False)


def test_unpooled_rows_read_to_the_batchs_longest_row_as_torchrec_pads_them():
    """``to_padded_dense()`` without ``desired_length``: as wide as the batch's longest history,
    which changes from call to call; one compile serves every width, in every layout."""
    whole = _Unpooled(lambda jt: jt.to_padded_dense(padding_value=-2.0)).eval()
    compiled = _compile(whole)
    for seed, histories in [(19, [5, 0, 2]), (20, [1, 7, 0, 3]), (21, [0, 1])]:
        batch = zoo.draw([2, 1, 3, 2][: len(histories)], seed=seed, histories=histories)
        with torch.no_grad():
            want = whole(batch.dense, batch.kjt)
        assert want.shape[1] == 4 * max(histories)  # the batch's longest row
        assert float(want.std()) > 0.1  # the rows differ far past the tolerance
        _check_layouts(whole, compiled, batch, False)
    empty = zoo.draw([2, 1], seed=22, histories=[0, 0])
    with pytest.raises(rocs.InputError, match=r"every row of key 'history' is empty"):
        compiled(empty.dense, empty.kjt)


def test_unpooled_reads_of_the_flat_values_are_refused():
    flat = _Unpooled(lambda jt: jt.values()[: jt.lengths().shape[0]]).eval()
    with pytest.raises(rocs.CompileError, match=r"through \.values\(\)"):
        _compile(flat)


# One pooled and one sequence model: the others look their keys up through the same modules.
@pytest.mark.parametrize("name", ["dlrm", "dlrm_transformer"])
def test_the_torch_compile_backend_runs_kjt_keys_unshared(name):
    """Dynamo traces TorchRec's jagged lookups (one embedding_bag over the whole batch), which
    no request name can split: the backend says so, and the model compiles and runs exactly,
    unshared."""
    torch._dynamo.reset()
    model, request, _ = zoo.build(name)
    with pytest.warns(UserWarning, match="cannot follow KeyedJaggedTensor keys"):
        backend = rocs.backend(request_inputs=request)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for counts, histories, seed in (([2, 3], [1, 4], 12), ([1, 2, 1], [0, 2, 3], 13)):
            batch = zoo.draw(counts, seed=seed, histories=histories)
            torch.testing.assert_close(
                compiled(batch.dense, batch.kjt), model(batch.dense, batch.kjt), rtol=1e-5, atol=1e-6
            )
    assert backend.subgraphs
    assert all(s.compiled_model is None and s.fallback_reason for s in backend.subgraphs)


def test_helpers_derive_the_request_names_and_layouts():
    model, _, _ = zoo.build("dlrm")
    keys = rocs_torchrec.keys_of_tables(model, ["t_user"])
    assert rocs_torchrec.request_inputs("sparse_features", keys) == ["sparse_features[user_id]"]
    with pytest.raises(ValueError, match="t_user, t_item, t_tag"):
        rocs_torchrec.keys_of_tables(model, ["t_users"])
    batch = zoo.draw([2, 1, 3], seed=13)
    request = _keys(batch.shared, list(zoo.REQUEST_KEYS))
    candidates = _keys(batch.shared, list(zoo.CANDIDATE_KEYS))
    shared = rocs_torchrec.shared_kjt(request, candidates, batch.index)
    assert shared.stride_per_key() == batch.shared.stride_per_key()
    assert torch.equal(shared.values(), batch.shared.values())
    replicated = rocs_torchrec.replicated_kjt(shared, batch.index, zoo.REQUEST_KEYS)
    assert torch.equal(replicated.values(), batch.kjt.values())
    assert torch.equal(replicated.lengths(), batch.kjt.lengths())
    with torch.no_grad():
        torch.testing.assert_close(model(batch.dense, shared), model(batch.dense, batch.kjt))


def test_the_library_imports_and_compiles_without_torchrec():
    code = (
        "import sys; sys.modules['torchrec'] = None\n"
        "import torch, rocs_compiler as rocs\n"
        "m = torch.nn.Linear(3, 1).eval()\n"
        "cm = rocs.compile(m, ['input'], example_inputs=(torch.randn(4, 3),))\n"
        "x = torch.randn(5, 3)\n"
        "assert torch.allclose(cm(x), m(x))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_export_takes_the_keys_as_padded_pieces():
    model, request, _ = zoo.build("dlrm")
    compiled = _compile(model, request)
    program = rocs.export(compiled)
    batch = zoo.draw([3, 1, 2], seed=14, histories=[4, 0, 1])
    pieces = compiled.input_format.splits[0].pieces(batch.shared)
    with torch.no_grad():
        got = program.module()(
            dense_features=batch.dense, sparse_features=pieces, candidate_to_request=batch.index
        )
        torch.testing.assert_close(got, model(batch.dense, batch.kjt))


@pytest.mark.parametrize("bad", ["longer than its ids", "negative"])
def test_a_saved_program_refuses_lengths_that_do_not_fit_the_ids(tmp_path, bad):
    """A key's padded piece claims ``lengths[b]`` of its ``W`` ids: a length past ``W`` or below
    zero is refused by the program itself (loaded, or run by torch's own module)."""
    model, request, _ = zoo.build("dlrm")
    compiled = _compile(model, request)
    rocs.save(rocs.export(compiled), tmp_path / "dlrm.pt2")
    program = rocs.load(tmp_path / "dlrm.pt2")
    batch = zoo.draw([3, 1, 2], seed=14, histories=[4, 0, 1])
    pieces = compiled.input_format.splits[0].pieces(batch.shared)
    key = next(iter(pieces))
    width = pieces[key]["ids"].shape[1]
    pieces[key]["lengths"] = pieces[key]["lengths"].clone()
    pieces[key]["lengths"][0] = -1 if bad == "negative" else width + 1
    call = {
        "dense_features": batch.dense, "sparse_features": pieces,
        "candidate_to_request": batch.index,
    }  # fmt: skip
    with torch.no_grad(), pytest.raises(rocs.InputError, match=f"{key}: lengths must lie in"):
        program(**call)
    with torch.no_grad(), pytest.raises(RuntimeError, match="lengths must lie in"):
        program.program.module()(**call)


@pytest.mark.parametrize("fast", ["shared", "plain"])
def test_drop_in_calls_keep_the_faster_of_the_pieces_program_and_the_model(monkeypatch, fast):
    """Drop-in calls alternate between the pieces program and the original model until each
    has run TRIALS times, then keep the one measured faster (here by a fake clock)."""
    from rocs_compiler.runtime.call import choosing, path
    from rocs_compiler.runtime.choice import program_choice
    from rocs_compiler.runtime.choice.program_choice import TRIALS, bucket

    model, request, _ = zoo.build("dlrm")
    compiled = _compile(model, request)
    batch = zoo.draw([3, 1, 2], seed=4, histories=[2, 0, 3])
    ran, clock = [], [0.0]
    original = compiled._original

    def model_call(*args, **kwargs):
        ran.append("plain")
        clock[0] += 1.0 if fast == "plain" else 2.0
        return original(*args, **kwargs)

    real_program = path.program_call

    def program_call(*args):
        ran.append("shared")
        clock[0] += 1.0 if fast == "shared" else 2.0
        return real_program(*args)

    monkeypatch.setattr(program_choice, "now", lambda: clock[0])
    monkeypatch.setattr(choosing, "call_clock", lambda on_cpu=True: lambda: clock[0])
    object.__setattr__(compiled, "_original", model_call)
    monkeypatch.setattr(path, "program_call", program_call)
    with torch.no_grad():
        want = model(batch.dense, batch.kjt)
        for _ in range(2 * TRIALS + 2):
            got = compiled(batch.dense, batch.kjt)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert ran == ["shared", "plain"] * TRIALS + [fast] * 2
    assert compiled.program_choices() == {bucket("dropin-original", batch.kjt.stride()): fast}


def test_shared_calls_with_inverse_indices_may_run_the_original_model():
    """A shared-layout KJT with TorchRec's inverse indices is read by the original model too
    (its EmbeddingBagCollection expands them): after the trials, every call is still exact."""
    from rocs_compiler.runtime.choice.program_choice import TRIALS

    model, request, _ = zoo.build("dlrm_dcn")
    compiled = _compile(model, request)
    batch = zoo.draw([3, 1, 2], seed=7, histories=[2, 0, 4])
    with torch.no_grad():
        want = model(batch.dense, batch.kjt)
        for _ in range(2 * TRIALS + 1):
            for got in (
                compiled(batch.dense, batch.shared),
                compiled(batch.dense, batch.shared, candidate_to_request=batch.index),
            ):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert any(k[0] == "shared-original" for k in compiled.program_choices())


# -- submodules replaced after compiling (issue 22, A6) -----------------------------------------
# The KJT wrapper compiles shallow copies of the modules above each collection; the compiled
# model must still follow the user's model: a replaced module of the same class and equal
# attributes is followed with its new weights, anything else refused naming its path.


def _replaced_is_followed(model, compiled, replace) -> None:
    """After ``replace(model)``, every layout (past the program choice's trials) equals the
    changed eager model, which differs from the model compiled."""
    from rocs_compiler.runtime.choice.program_choice import TRIALS

    batch = zoo.draw([3, 1, 2], seed=11, histories=[2, 0, 4])
    with torch.no_grad():
        before = model(batch.dense, batch.kjt)
        replace(model)
        assert not torch.allclose(model(batch.dense, batch.kjt), before)
        for _ in range(2 * TRIALS + 1):
            _check_layouts(model, compiled, batch)


def _replaced_is_refused(model, compiled, replace, match: str) -> None:
    batch = zoo.draw([2, 2], seed=12)
    replace(model)
    with torch.no_grad():
        for call in (
            lambda: compiled(batch.dense, batch.kjt),
            lambda: compiled(batch.dense, batch.shared),
            lambda: compiled(batch.dense, batch.shared, candidate_to_request=batch.index),
        ):
            with pytest.raises(rocs.CompileError, match=match):
                call()


def _over_arch(layer_sizes):
    from torchrec.models.dlrm import OverArch

    torch.manual_seed(21)
    return OverArch(in_features=18, layer_sizes=layer_sizes).eval()  # dense + 6 pairwise dots


def test_a_replaced_over_arch_of_the_same_shape_is_followed():
    model, request, _ = zoo.build("dlrm")
    compiled = _compile(model, request)
    _replaced_is_followed(model, compiled, lambda m: setattr(m, "over_arch", _over_arch([16, 1])))


@pytest.mark.parametrize(
    "replacement, match",
    [
        (lambda: _over_arch([8, 1]), r"over_arch\.model\.0\._mlp\.0\._linear\.weight .*shape"),
        (lambda: nn.Sequential(nn.Linear(18, 1)).eval(), r"model\.over_arch was replaced"),
    ],
    ids=["another_shape", "another_class"],
)
def test_a_replaced_over_arch_of_another_shape_or_class_is_refused(replacement, match):
    model, request, _ = zoo.build("dlrm")
    compiled = _compile(model, request)
    new = replacement()
    _replaced_is_refused(model, compiled, lambda m: setattr(m, "over_arch", new), match)


def _set_collection(model, collection) -> None:
    torch.manual_seed(22)
    collection.reset_parameters()
    model.sparse_arch.embedding_bag_collection = collection.eval()


@pytest.mark.parametrize("configs", ["the_same", "equal"])
def test_a_replaced_embedding_bag_collection_of_the_same_tables_is_followed(configs):
    """Built from the compiled collection's table configs, or from new configs equal to them
    (a dataclass compared field by field, its initializer by function and arguments)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    model, request, _ = zoo.build("dlrm")
    compiled = _compile(model, request)
    old = model.sparse_arch.embedding_bag_collection
    tables = old.embedding_bag_configs() if configs == "the_same" else None
    new = EmbeddingBagCollection(tables=tables) if tables is not None else zoo.collection()
    _replaced_is_followed(model, compiled, lambda m: _set_collection(m, new))


class _OtherCollection(type(zoo.collection())):
    """An ``EmbeddingBagCollection`` subclass: another class, another forward."""


def test_a_replaced_embedding_bag_collection_of_other_tables_or_class_is_refused():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    model, request, _ = zoo.build("dlrm")
    compiled = _compile(model, request)
    configs = model.sparse_arch.embedding_bag_collection.embedding_bag_configs()
    bigger = [
        EmbeddingBagConfig(name=c.name, embedding_dim=c.embedding_dim,
                           num_embeddings=c.num_embeddings + 5, feature_names=c.feature_names,
                           pooling=c.pooling)
        for c in configs
    ]  # fmt: skip
    new = EmbeddingBagCollection(tables=bigger)
    where = r"model\.sparse_arch\.embedding_bag_collection"
    _replaced_is_refused(
        model, compiled, lambda m: _set_collection(m, new), f"{where}._embedding_bag_configs"
    )
    model, request, _ = zoo.build("dlrm")
    compiled = _compile(model, request)
    other = _OtherCollection(tables=configs)
    _replaced_is_refused(
        model, compiled, lambda m: _set_collection(m, other), f"{where} was replaced"
    )


def test_the_request_cache_serves_the_dlrm_in_every_layout():
    """The DLRM's request keys reach the program as padded pieces, a 1-D lengths piece among
    them: drop-in calls of one request (a single strided row) included, a second call hits
    every request and returns the first call's bits."""
    model, request, _ = zoo.build("dlrm")
    cache = rocs.RequestCache(1 << 22, autotune=False)
    compiled = _compile(model, request, options={"autotune": False}, request_cache=cache)
    for counts in ([3], [2, 2], [1, 4, 2]):
        batch = zoo.draw(counts, seed=len(counts), histories=[2] * len(counts))
        with torch.no_grad():
            want = model(batch.dense, batch.kjt)
            calls = {
                "drop-in": lambda: compiled(batch.dense, batch.kjt),
                "shared": lambda: compiled(
                    batch.dense, batch.shared, candidate_to_request=batch.index
                ),
            }
            for layout, call in calls.items():
                hits = cache.stats()["hits"]
                first, second = call(), call()
                assert torch.equal(first, second), (counts, layout)
                assert cache.stats()["hits"] >= hits + len(counts), (counts, layout)
                torch.testing.assert_close(second, want, rtol=1e-5, atol=1e-6, msg=layout)


def test_a_drop_in_bucket_that_chose_the_model_runs_it_as_called():
    """A drop-in bucket whose program choice kept the original model runs it on the call as
    made, positional or keyword, without the guards: the model as it is now (an over-arch of
    another class, which the guards refuse for a compiled program, is what it runs). A KJT with
    a batch size per key (the shared layout) does not take that lane."""
    from rocs_compiler.runtime.choice.program_choice import PLAIN, bucket

    model, request, _ = zoo.build("dlrm")
    compiled = _compile(model, request)
    batch = zoo.draw([3, 1, 2], seed=15, histories=[2, 0, 3])
    compiled._choice.settle(bucket("dropin-original", batch.kjt.stride()), PLAIN)
    model.over_arch = nn.Sequential(nn.Linear(18, 1)).eval()
    with torch.no_grad():
        want = model(batch.dense, batch.kjt)
        torch.testing.assert_close(compiled(batch.dense, batch.kjt), want)
        torch.testing.assert_close(
            compiled(dense_features=batch.dense, sparse_features=batch.kjt), want
        )
        with pytest.raises(rocs.CompileError, match=r"model\.over_arch was replaced"):
            compiled(batch.dense, batch.shared)


def test_a_shared_kjt_in_a_bucket_that_chose_the_model_runs_it_as_called():
    """A shared-layout KJT whose bucket kept the original model runs it as called without
    reading its inverse indices, inside ``rocs.trusted_index()`` or not: on a valid grouping
    that is the replicated call's answer; on inverse indices the shared program refuses (a
    candidate key's rows reordered) it is TorchRec's own answer, the model's reading of them.
    Before the bucket is decided the shared program may run, and the same call is checked and
    refused."""
    from rocs_compiler.runtime.choice.program_choice import PLAIN, bucket

    model, request, _ = zoo.build("dlrm")
    compiled = _compile(model, request)
    batch = zoo.draw([3, 1, 2], seed=16, histories=[2, 0, 3])
    scrambled = rocs_torchrec.shared_kjt(
        _keys(batch.shared, list(zoo.REQUEST_KEYS)),
        _keys(batch.shared, list(zoo.CANDIDATE_KEYS)),
        batch.index,
    )
    scrambled.inverse_indices()[1][2] = scrambled.inverse_indices()[1][2].flip(0)
    with torch.no_grad():
        want = model(batch.dense, batch.kjt)
        reordered = model(batch.dense, scrambled)
        assert not torch.allclose(reordered, want)
        with pytest.raises(rocs.InputError, match="candidate key"):
            compiled(batch.dense, scrambled)  # undecided: the checked path
        with rocs.trusted_index(), pytest.raises(rocs.InputError, match="candidate key"):
            compiled(batch.dense, scrambled)
        compiled._choice.settle(bucket("shared-original", 6, 3), PLAIN)
        for trusted in (False, True):
            with rocs.trusted_index() if trusted else contextlib.nullcontext():
                torch.testing.assert_close(compiled(batch.dense, batch.shared), want)
                torch.testing.assert_close(
                    compiled(dense_features=batch.dense, sparse_features=batch.shared), want
                )
                torch.testing.assert_close(compiled(batch.dense, scrambled), reordered)
        sharing = _compile(model, request, options={"autotune": False})
        with pytest.raises(rocs.InputError, match="candidate key"):
            sharing(batch.dense, scrambled)  # the shared program: checked
        torch.testing.assert_close(sharing(batch.dense, batch.shared), want)


class _Strides:
    """What ``KJTSplit.request_rows`` reads of a KJT: its keys and rows per key."""

    def __init__(self, keys, strides):
        self._keys, self._strides = list(keys), list(strides)

    def keys(self):
        return self._keys

    def stride_per_key(self):
        return self._strides


def test_request_rows_read_by_position_or_by_name():
    split = KJTSplit("sparse_features", ("user_id", "history", "item_id"),
                     frozenset({"user_id", "history"}), False)  # fmt: skip
    assert split.request_rows(_Strides(["user_id", "history", "item_id"], [3, 2, 8])) == 3
    assert split.request_rows(_Strides(["item_id", "history", "user_id"], [8, 2, 3])) == 3
    assert split.request_rows(_Strides(["item_id", "history"], [8, 5])) is None  # no user_id
    no_request = KJTSplit("sparse_features", ("item_id",), frozenset(), False)
    assert no_request.request_rows(_Strides(["item_id"], [8])) == 0
    shared = zoo.draw([2, 1, 3], seed=0).shared  # TorchRec's own KJT: 3 requests, 6 candidates
    split = KJTSplit("sparse_features", tuple(shared.keys()), frozenset(zoo.REQUEST_KEYS), False)
    assert split.request_rows(shared) == 3
