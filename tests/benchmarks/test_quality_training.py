"""``quality.py --trainer``'s helper: requests are rows with equal request features, and training
through a training compile on request-grouped batches follows eager on the same batches.

Runs in-process on the synthetic MovieLens-format data (one small backbone, one epoch); quality
numbers on that data mean nothing, so only the losses' agreement and finiteness are checked.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import movielens
import quality
import quality_training as qt


def test_request_ids_split_a_user_whose_history_changes():
    data = {
        "user_sparse": torch.tensor([[1, 2], [1, 2], [1, 2], [3, 4], [1, 2]]),
        "history": torch.tensor([[5, 0], [5, 0], [5, 6], [5, 0], [5, 0]]),
        "dense": torch.tensor([0.5, 0.5, 0.5, 0.5, -0.0]),
    }
    ids = qt.request_ids(data, ["user_sparse", "history"])
    assert ids[0] == ids[1] == ids[4]  # same user, same history: one request
    assert len({int(ids[0]), int(ids[2]), int(ids[3])}) == 3  # user 1 later; another user
    ids = qt.request_ids(data, ["user_sparse", "history", "dense"])
    assert ids[0] == ids[1] and ids[4] != ids[0]  # floats compare by bits (-0.0 is not 0.5)


def test_rocs_training_follows_eager_on_the_same_grouped_batches():
    ml = movielens.load(quality.SYNTHETIC)
    train = {k: v[:400] for k, v in ml.train.items()}
    # Pairs of rows share their request features, so batches hold R < N requests.
    pairs = torch.arange(400) // 2 * 2
    for name in movielens.REQUEST_INPUTS:
        train[name] = train[name][pairs]
    example = quality.example_batch(train)
    config = quality.backbone_config("dcnv2", 8, quick=True)
    fit = {"epochs": 1, "batch_size": 64, "lr": 1e-3, "seed": 0, "window": 0}
    runs = {}
    for through in ("eager", "rocs"):
        model = quality.Variant("dcnv2", "vanilla").build(ml.schema, config, 0, example)
        runs[through] = qt.train_grouped(
            model, train, through=through, features=movielens.FEATURES,
            requests=movielens.REQUEST_INPUTS, example=example,
            progress=lambda total: quality.Progress(total, "", enabled=False), **fit,
        )  # fmt: skip
        logits = quality.predict(model, ml.test)
        assert math.isfinite(quality.auc(logits, ml.test["label"]))
    eager, compiled = (runs[k]["first_epoch_losses"] for k in ("eager", "rocs"))
    assert len(eager) == len(compiled) >= 6
    assert abs(eager[0] - compiled[0]) < 1e-6  # same weights, same batch: the same loss
    assert qt.loss_gap(eager, compiled) < 1e-4
    assert runs["rocs"]["impressions_per_request"] == runs["eager"]["impressions_per_request"] == 2
    assert runs["rocs"]["compile_seconds"] > 0 and runs["eager"]["compile_seconds"] == 0
