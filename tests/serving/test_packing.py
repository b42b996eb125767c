"""Packing without Ray: requests checked, packed into one shared-layout call and split back equal
the original model on each request alone (zoo, dict-input, KJT models and a saved program), and
every bad request is refused with a one-line error naming its field before it is packed."""

from __future__ import annotations

import json

import pytest
import serving_models as H
import torch
from models_for_tests import DICT_FEATURES

import rocs_compiler as rocs
from models_zoo import ZOO
from rocs_compiler.serving import protocol
from rocs_compiler.serving.packing import Jagged, pack, split
from rocs_compiler.serving.schema import CANDIDATE, REQUEST, Field, RequestError, Schema
from rocs_compiler.serving.served import served_model

COUNTS = [1, 7, 300]  # one batch with a single candidate, a few, and many


def _check(served, model, bodies, alone):
    requests = [served.schema.check(json.loads(json.dumps(b))) for b in bodies]
    packed = pack(served.schema, requests)
    assert packed.counts == COUNTS and packed.num_candidates == sum(COUNTS)
    shared = split(served(packed), packed.counts)
    plain = split(served(packed, plain=True), packed.counts)
    for body, got, baseline in zip(bodies, shared, plain):
        want = alone(model, body)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(baseline, want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def two_tower():
    return H.zoo_compiled("two_tower", options=H.NO_AUTOTUNE)


def _zoo_bodies(name):
    entry = ZOO[name]
    return H.dense_requests(entry.make_batch(COUNTS, seed=3), entry.request_inputs)


def test_zoo_model_packed_equals_each_request_alone(two_tower):
    model, compiled = two_tower
    _check(served_model(compiled), model, _zoo_bodies("two_tower"), H.dense_alone)


def test_saved_program_packed_equals_each_request_alone(two_tower, tmp_path):
    model, compiled = two_tower
    path = tmp_path / "two_tower.pt2"
    rocs.save(rocs.export(compiled), path)
    served = served_model(str(path))
    assert served.kind == "saved program"
    assert [f.name for f in served.schema.request_fields] == list(ZOO["two_tower"].request_inputs)
    _check(served, model, _zoo_bodies("two_tower"), H.dense_alone)


def test_dict_input_model_packed_equals_each_request_alone():
    model = DICT_FEATURES.build()
    served = served_model(DICT_FEATURES.compile(model, options=H.NO_AUTOTUNE))
    assert {f.name: f.side for f in served.schema.fields} == {
        "features.user_age": REQUEST,
        "features.user_dense": REQUEST,
        "features.item_dense": CANDIDATE,
    }
    batch = DICT_FEATURES.batch(COUNTS, seed=4)
    bodies = H.dense_requests(batch, DICT_FEATURES.request_inputs)
    _check(served, model, bodies, H.dense_alone)


@pytest.mark.slow
def test_aoti_package_packed_equals_each_request_alone(tmp_path):
    """An AOTInductor package (``rocs.aoti_package``; about a minute of C++ compile on two cores,
    so not in the default run) serves with the fields of the program it was built from, nested
    dict inputs included; one without rocs's description of its inputs is refused, saying how
    to package it."""
    model = DICT_FEATURES.build()
    program = rocs.export(DICT_FEATURES.compile(model, options=H.NO_AUTOTUNE))
    path = rocs.aoti_package(program, tmp_path / "dict_aoti.pt2")
    served = served_model(path)
    assert served.kind == "AOTInductor package"
    assert {f.name: f.side for f in served.schema.fields} == {
        "features.user_age": REQUEST,
        "features.user_dense": REQUEST,
        "features.item_dense": CANDIDATE,
    }
    batch = DICT_FEATURES.batch(COUNTS, seed=4)
    _check(served, model, H.dense_requests(batch, DICT_FEATURES.request_inputs), H.dense_alone)
    bare = torch._inductor.aoti_compile_and_package(
        program.program if hasattr(program, "program") else program,
        package_path=str(tmp_path / "bare_aoti.pt2"),
    )
    with pytest.raises(rocs.CompileError, match=r"rocs.aoti_package"):
        served_model(bare)


def test_a_saved_program_is_not_taken_for_an_aoti_package(two_tower, tmp_path):
    from rocs_compiler.export import input_signature
    from rocs_compiler.serving.served import is_aoti_package

    path = tmp_path / "two_tower.pt2"
    rocs.save(rocs.export(two_tower[1]), path)
    assert not is_aoti_package(str(path))
    assert not is_aoti_package(str(tmp_path / "missing.pt2"))
    assert input_signature(rocs.load(path).program)["candidate_to_request"]["dtype"] == "int64"


def test_kjt_model_packed_equals_each_request_alone():
    pytest.importorskip("torchrec")
    model, compiled = H.kjt_model()
    served = served_model(compiled)
    jagged = {f.name for f in served.schema.fields if f.jagged}
    assert jagged == {
        f"sparse_features[{k}]" for k in ("user_id", "history", "item_id", "item_tags")
    }
    _check(served, model, H.kjt_requests(COUNTS, seed=5), H.kjt_alone)


def test_outputs_split_per_request_keep_the_structure():
    outputs = {"ctr": torch.arange(5.0), "pair": (torch.ones(5, 2), 3.0)}
    parts = split(outputs, [2, 3])
    assert parts[0]["ctr"].tolist() == [0.0, 1.0] and parts[1]["ctr"].tolist() == [2.0, 3.0, 4.0]
    assert parts[1]["pair"][0].shape == (3, 2) and parts[1]["pair"][1] == 3.0
    assert protocol.scores(parts[0]) == {
        "scores": {"ctr": [0.0, 1.0], "pair": [[[1.0, 1.0]] * 2, 3.0]}
    }


# -- the check of one request ---------------------------------------------------------------------

SCHEMA = Schema(
    [
        Field("user_id", REQUEST, torch.int64),
        Field("user_dense", REQUEST, torch.float32, (3,)),
        Field("history", REQUEST, torch.int64, (None,)),
        Field("item_id", CANDIDATE, torch.int64),
        Field("item_dense", CANDIDATE, torch.float32, (2,)),
        Field("tags", CANDIDATE, torch.int64, (), jagged=True),
    ]
)


def _body(**changes):
    body = {
        "request": {"user_id": 4, "user_dense": [0.5, 1, 2], "history": [1, 2]},
        "candidates": {"item_id": [7, 8], "item_dense": [[1, 2], [3, 4.5]], "tags": [[1], []]},
    }
    return H.changed(body, **changes)


def test_a_good_request_is_packed_with_padding_and_jagged_rows():
    first = SCHEMA.check(_body())
    second = SCHEMA.check(_body(request__history=[5, 6, 7], candidates__item_id=[1, 2]))
    packed = pack(SCHEMA, [first, second])
    assert packed.index.tolist() == [0, 0, 1, 1]
    assert packed.leaves["history"].tolist() == [[1, 2, 0], [5, 6, 7]]  # zeros to the longest
    assert packed.leaves["user_dense"].dtype == torch.float32
    tags = packed.leaves["tags"]
    assert isinstance(tags, Jagged) and tags.lengths.tolist() == [1, 0, 1, 0]
    assert tags.values.tolist() == [1, 1]


@pytest.mark.parametrize(
    "body, field, words",
    [
        ([1, 2], "body", "must be an object"),
        ({"request": {}, "candidates": {}, "extra": 1}, "extra", "unknown key"),
        (_body(request__user_dense=None), "user_dense", "missing request feature"),
        (_body(request__age=3), "age", "unknown feature"),
        (_body(request__item_id=3), "item_id", "is a candidate feature"),
        (_body(candidates__item_id=[1.5, 2]), "item_id", "must hold integers, got numbers"),
        (_body(candidates__item_dense=[[1, 2, 3], [4, 5, 6]]), "item_dense", "shape [2, 2]"),
        (_body(request__user_dense=[1, "a", 2]), "user_dense", "must hold numbers"),
        (_body(candidates__item_dense=[[1, 2], [3]]), "item_dense", "not a regular array"),
        (_body(candidates__item_id=[1, 2, 3]), "item_id", "disagree in length"),
        (
            _body(candidates__item_id=[], candidates__item_dense=[], candidates__tags=[]),
            "item_id",
            "at least one candidate",
        ),
        (_body(candidates__tags=[[1], [[2]]]), "tags", "a list of ids per row"),
        (_body(candidates__item_id=5), "item_id", "must be a list"),
        ({"request": [], "candidates": {}}, "request", "must be an object"),
    ],
)
def test_a_bad_request_is_refused_naming_its_field(body, field, words):
    with pytest.raises(RequestError) as caught:
        SCHEMA.check(body)
    assert caught.value.field == field and caught.value.status == 400
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_malformed_json_and_oversized_bodies():
    with pytest.raises(RequestError, match="malformed JSON") as caught:
        protocol.decode(b'{"request": ', 1000)
    assert caught.value.status == 400 and caught.value.field == "body"
    with pytest.raises(RequestError, match="over the limit") as caught:
        protocol.decode(b"x" * 11, 10)
    assert caught.value.status == 413


def test_tensors_and_arrays_are_taken_as_rows():
    import numpy as np

    body = _body(
        request__user_dense=torch.tensor([1.0, 2, 3]), candidates__item_id=np.array([1, 2])
    )
    request = SCHEMA.check(body)
    assert request.num_candidates == 2 and request.candidates["item_id"].dtype == torch.int64
    with pytest.raises(RequestError, match="must hold integers"):
        SCHEMA.check(_body(candidates__item_id=torch.tensor([1.0, 2.0])))


# -- values: ids inside the model's tables, finite features ---------------------------------------


def _refused(served, body) -> RequestError:
    with pytest.raises(RequestError) as caught:
        served.schema.check(json.loads(json.dumps(body)))
    assert caught.value.status == 400 and "\n" not in str(caught.value)
    return caught.value


def test_ids_past_a_table_or_negative_are_refused_naming_the_field(two_tower, tmp_path):
    """Each served id field knows the rows of the tables it looks up (``nn.Embedding``, the
    history's ``nn.EmbeddingBag``), in a compiled model and in its saved program alike."""
    model, compiled = two_tower
    path = tmp_path / "two_tower.pt2"
    rocs.save(rocs.export(compiled), path)
    good = _zoo_bodies("two_tower")[1]
    rows = {"user_id": 20000, "hist_item_ids": 50000, "item_id": 50000, "item_cat": 1000}
    for served in (served_model(compiled), served_model(str(path))):
        served.schema.check(good)
        for field, n in rows.items():
            part = "request" if field in ZOO["two_tower"].request_inputs else "candidates"
            for bad in (n, -1):
                value = torch.tensor(good[part][field])
                value.view(-1)[-1] = bad
                err = _refused(served, H.changed(good, **{f"{part}__{field}": value.tolist()}))
                assert err.field == field and f"id {bad} " in str(err), err
                assert f"of {n} rows" in str(err)
        largest = H.changed(good, candidates__item_cat=[999] * 7)  # the last row is an id
        served.schema.check(largest)


def test_ids_of_one_column_are_checked_against_its_own_table():
    """DLRM's ``user_sparse`` column j looks up table j: an id fits one column and not another."""
    model, compiled = H.zoo_compiled("dlrm", options=H.NO_AUTOTUNE)
    served = served_model(compiled)
    good = _zoo_bodies("dlrm")[0]
    sizes = [t.num_embeddings for t in model.user_tables]
    small = min(range(len(sizes)), key=sizes.__getitem__)
    large = max(range(len(sizes)), key=sizes.__getitem__)
    row = list(good["request"]["user_sparse"])
    row[large] = sizes[small]  # fits the large table
    served.schema.check(H.changed(good, request__user_sparse=row))
    row[small] = sizes[small]
    err = _refused(served, H.changed(good, request__user_sparse=row))
    assert err.field == "user_sparse" and f"index {small})" in str(err), err


def test_kjt_ids_past_a_table_are_refused_naming_the_key():
    pytest.importorskip("torchrec")
    model, compiled = H.kjt_model()
    served = served_model(compiled)
    from models_zoo import torchrec_models as tz

    good = H.kjt_requests([3], seed=5)[0]
    served.schema.check(good)
    cases = {
        ("request", "sparse_features[history]"): [1, tz.VOCAB["item_id"]],
        ("request", "sparse_features[user_id]"): [-3],
        ("candidates", "sparse_features[item_tags]"): [[1], [], [tz.VOCAB["item_tags"], 0]],
    }
    for (part, field), value in cases.items():
        err = _refused(served, H.changed(good, **{f"{part}__{field}": value}))
        assert err.field == field and "outside embedding table" in str(err), err


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_features_are_refused_naming_the_field(two_tower, value):
    good = _zoo_bodies("two_tower")[1]
    dense = [list(row) for row in good["candidates"]["item_dense"]]
    dense[-1][0] = value
    for body, field in (
        (H.changed(good, candidates__item_dense=dense), "item_dense"),
        (H.changed(good, request__user_dense=[value] * len(good["request"]["user_dense"])),
         "user_dense"),
    ):  # fmt: skip
        err = _refused(served_model(two_tower[1]), body)
        assert err.field == field and "NaN or infinity" in str(err), err


def test_non_finite_outputs_are_written_as_null():
    """A model's own overflow on finite features: JSON has no NaN, so such a score is null."""
    out = protocol.scores({"ctr": torch.tensor([0.5, float("nan"), float("inf")]), "n": 2})
    assert out == {"scores": {"ctr": [0.5, None, None], "n": 2}}
    json.dumps(out, allow_nan=False)


class _PlainSharedLayout(torch.nn.Module):
    """A shared-layout program in plain ATen, as ``rocs.export(..., portable=True)`` makes: the
    request side at R rows, gathered to the candidates by ``candidate_to_request``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.users, self.items = torch.nn.Embedding(40, 4), torch.nn.Embedding(60, 4)
        self.tags = torch.nn.EmbeddingBag(12, 4, mode="sum")

    def forward(self, user_id, user_tags, item_id, candidate_to_request):
        user = self.users(user_id) + self.tags(user_tags)
        return (user.index_select(0, candidate_to_request) * self.items(item_id)).sum(1)


def test_a_plain_torch_export_program_serves_with_its_id_ranges(tmp_path):
    """A program saved by ``torch.export.save`` with no ``rocs::`` op (the portable form) serves
    as a ``rocs.save`` one does, its tables' rows read from its graph."""
    module = _PlainSharedLayout().eval()
    requests, candidates = torch.export.Dim("R"), torch.export.Dim("N")
    example = {"user_id": torch.tensor([1, 2]), "user_tags": torch.tensor([[1, 2], [3, 4]]),
               "item_id": torch.tensor([5, 6, 7]),
               "candidate_to_request": torch.tensor([0, 1, 1])}  # fmt: skip
    shapes = {"user_id": {0: requests}, "user_tags": {0: requests}, "item_id": {0: candidates},
              "candidate_to_request": {0: candidates}}  # fmt: skip
    path = tmp_path / "plain.pt2"
    torch.export.save(torch.export.export(module, (), example, dynamic_shapes=shapes), path)
    served = served_model(str(path))
    assert {f.name: [r.rows for r in f.ids] for f in served.schema.fields} == {
        "user_id": [40], "user_tags": [12], "item_id": [60]
    }  # fmt: skip
    bodies = [
        {"request": {"user_id": u, "user_tags": [u % 12, 3]},
         "candidates": {"item_id": [i % 60 for i in range(n)]}}
        for u, n in zip((3, 7, 9), COUNTS)
    ]  # fmt: skip
    packed = pack(served.schema, [served.schema.check(b) for b in bodies])
    for body, got in zip(bodies, split(served(packed), packed.counts)):
        request, items = body["request"], torch.tensor(body["candidates"]["item_id"])
        with torch.no_grad():
            alone = module(torch.tensor([request["user_id"]]), torch.tensor([request["user_tags"]]),
                           items, torch.zeros(len(items), dtype=torch.long))  # fmt: skip
        torch.testing.assert_close(got, alone)
    err = _refused(served, H.changed(bodies[0], request__user_tags=[1, 12]))
    assert err.field == "user_tags" and "of 12 rows" in str(err)
