"""MovieLens-100K as (request, candidate) ranking examples, split by time.

Every rating is one example; the label is ``rating >= 4``.

Request features (the user at the moment of the rating):
    user_sparse  int64 [n, 4]   user id, age bucket, gender, occupation
    history      int64 [n, 20]  items the user rated strictly before this rating's timestamp,
                                the most recent 20, oldest first, 0-padded at the end
Candidate features (the rated movie):
    item_sparse    int64   [n, 2]   item id, release-year bucket (0 = unknown)
    item_multihot  float32 [n, 19]  genres

Split: ratings with timestamp below the global 80% timestamp quantile train, the rest test, so
no test rating (and no rating after it) informs training. Histories only look back in time, so a
test example's history may include earlier test-period ratings, as it would when serving.

The data set is not distributed with this repository; ``--data`` points at an unpacked
``ml-100k`` directory (files ``u.data``, ``u.user``, ``u.item``, ``u.occupation``). For tests and
``--quick`` runs, :func:`write_synthetic` writes a tiny random data set in the same format.

Usage::

    python benchmarks/movielens.py --data ../shared/data/ml-100k        # summary of the split
    python benchmarks/movielens.py --write-synthetic tests/data/ml-synthetic
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "ml-100k"

HISTORY_LENGTH = 20
NUM_GENRES = 19
AGE_EDGES = (18, 25, 35, 45, 50, 56)  # buckets 1..7: <18, 18-24, ..., 56+
YEAR_START, YEAR_STEP, YEAR_BUCKETS = 1920, 5, 17  # bucket 1 + (year - 1920) // 5, 0 = unknown
GENDERS = {"M": 1, "F": 2}
TRAIN_FRACTION = 0.8

FEATURES = ("user_sparse", "history", "item_sparse", "item_multihot")
REQUEST_INPUTS = ("user_sparse", "history")


@dataclass
class MovieLens:
    """Examples of both splits as tensors; ``schema`` sizes the embedding tables."""

    train: dict[str, torch.Tensor]
    test: dict[str, torch.Tensor]
    num_users: int
    num_items: int
    num_occupations: int
    split_timestamp: int
    items: dict[str, torch.Tensor] = field(
        default_factory=dict
    )  # per item id: item_sparse, multihot

    @property
    def schema(self):
        from models_zoo.backbones import FeatureSchema

        return FeatureSchema(
            request_vocabs=(
                self.num_users + 1,
                len(AGE_EDGES) + 2,
                len(GENDERS) + 1,
                self.num_occupations + 1,
            ),
            num_items=self.num_items + 1,
            history_length=HISTORY_LENGTH,
            candidate_vocabs=(YEAR_BUCKETS + 1,),
            multihot=NUM_GENRES,
        )

    def summary(self) -> dict:
        def part(d):
            return {
                "rows": int(d["label"].numel()),
                "positive_rate": round(float(d["label"].mean()), 4),
                "empty_history_rate": round(float((d["history"][:, 0] == 0).float().mean()), 4),
            }

        return {
            "users": self.num_users,
            "items": self.num_items,
            "split_timestamp": self.split_timestamp,
            "split_time_utc": datetime.datetime.fromtimestamp(
                self.split_timestamp, datetime.timezone.utc
            ).strftime("%Y-%m-%d %H:%M"),
            "train": part(self.train),
            "test": part(self.test),
        }


def _read_lines(path: Path) -> list[str]:
    return path.read_text(encoding="latin-1").splitlines()


def _age_bucket(age: int) -> int:
    return 1 + int(np.searchsorted(AGE_EDGES, age, side="right"))


def _year_bucket(release: str) -> int:
    try:
        year = datetime.datetime.strptime(release.strip(), "%d-%b-%Y").year
    except ValueError:
        return 0
    return 1 + min(max((year - YEAR_START) // YEAR_STEP, 0), YEAR_BUCKETS - 1)


def load(path: str | Path = DEFAULT_DATA) -> MovieLens:
    """Read an ``ml-100k`` directory and build both splits."""
    path = Path(path)
    missing = [n for n in ("u.data", "u.user", "u.item", "u.occupation") if not (path / n).exists()]
    if missing:
        raise FileNotFoundError(
            f"{path} is not an ml-100k directory (missing {', '.join(missing)})"
        )
    occupations = {
        name: i + 1
        for i, name in enumerate(l.strip() for l in _read_lines(path / "u.occupation") if l.strip())
    }

    users = [l.split("|") for l in _read_lines(path / "u.user") if l.strip()]
    num_users = max(int(u[0]) for u in users)
    user_table = np.zeros((num_users + 1, 4), dtype=np.int64)
    for uid, age, gender, occupation, _zip in users:
        u = int(uid)
        user_table[u] = (
            u,
            _age_bucket(int(age)),
            GENDERS.get(gender, 0),
            occupations.get(occupation, 0),
        )

    items = [l.split("|") for l in _read_lines(path / "u.item") if l.strip()]
    num_items = max(int(i[0]) for i in items)
    item_sparse = np.zeros((num_items + 1, 2), dtype=np.int64)
    item_genres = np.zeros((num_items + 1, NUM_GENRES), dtype=np.float32)
    for fields in items:
        i = int(fields[0])
        item_sparse[i] = (i, _year_bucket(fields[2]))
        item_genres[i] = [float(g) for g in fields[-NUM_GENRES:]]

    ratings = np.array(
        [[int(x) for x in l.split("\t")] for l in _read_lines(path / "u.data") if l.strip()],
        dtype=np.int64,
    )
    user, item, rating, ts = ratings.T
    history = _histories(user, item, ts)
    split = int(np.quantile(ts, TRAIN_FRACTION))
    is_train = ts < split

    def rows(select: np.ndarray) -> dict[str, torch.Tensor]:
        order = np.argsort(ts[select], kind="stable")
        idx = np.flatnonzero(select)[order]
        return {
            "user_sparse": torch.from_numpy(user_table[user[idx]]),
            "history": torch.from_numpy(history[idx]),
            "item_sparse": torch.from_numpy(item_sparse[item[idx]]),
            "item_multihot": torch.from_numpy(item_genres[item[idx]]),
            "label": torch.from_numpy((rating[idx] >= 4).astype(np.float32)),
            "timestamp": torch.from_numpy(ts[idx]),
        }

    return MovieLens(
        rows(is_train),
        rows(~is_train),
        num_users,
        num_items,
        len(occupations),
        split,
        {
            "item_sparse": torch.from_numpy(item_sparse),
            "item_multihot": torch.from_numpy(item_genres),
        },
    )


def _histories(
    user: np.ndarray, item: np.ndarray, ts: np.ndarray, length: int = HISTORY_LENGTH
) -> np.ndarray:
    """Per rating: the user's items with a strictly smaller timestamp, the last ``length`` of
    them in time order, 0-padded at the end."""
    out = np.zeros((len(user), length), dtype=np.int64)
    order = np.lexsort((item, ts, user))  # by user, then time (ties in a fixed order)
    bounds = np.flatnonzero(np.diff(user[order])) + 1
    for rows in np.split(order, bounds):
        times, items = ts[rows], item[rows]
        before = np.searchsorted(times, times, side="left")  # count of strictly earlier ratings
        for row, end in zip(rows, before):
            seq = items[max(0, end - length) : end]
            out[row, : len(seq)] = seq
    return out


# -------------------------------------------------------------------------------------------------
# A tiny synthetic data set in the same format (for tests and --quick)


def write_synthetic(
    path: str | Path,
    *,
    num_users: int = 60,
    num_items: int = 80,
    num_ratings: int = 2400,
    seed: int = 0,
) -> Path:
    """Write random ``u.data``/``u.user``/``u.item``/``u.occupation``/``u.genre`` files.

    Ratings follow a small latent-factor model plus user and genre biases, so a model can learn
    something; this is a format fixture, not a benchmark.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    occupations = ["administrator", "artist", "doctor", "engineer", "student", "other"]
    genres = [f"genre{i}" for i in range(NUM_GENRES)]
    (path / "u.occupation").write_text("\n".join(occupations) + "\n")
    (path / "u.genre").write_text("".join(f"{g}|{i}\n" for i, g in enumerate(genres)) + "\n")
    user_lines = [
        f"{u}|{rng.integers(12, 70)}|{'MF'[rng.integers(2)]}|{occupations[rng.integers(len(occupations))]}|"
        f"{rng.integers(10000, 99999)}"
        for u in range(1, num_users + 1)
    ]
    (path / "u.user").write_text("\n".join(user_lines) + "\n")
    months = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
    item_genres = rng.random((num_items + 1, NUM_GENRES)) < 0.15
    item_lines = []
    for i in range(1, num_items + 1):
        date = (
            ""
            if rng.random() < 0.05
            else f"01-{months[rng.integers(12)]}-{rng.integers(1930, 1999)}"
        )
        flags = "|".join(str(int(g)) for g in item_genres[i])
        item_lines.append(f"{i}|Movie {i} (1990)|{date}||http://example.invalid/{i}|{flags}")
    (path / "u.item").write_text("\n".join(item_lines) + "\n")
    u_vec, i_vec = rng.normal(size=(num_users + 1, 4)), rng.normal(size=(num_items + 1, 4))
    genre_bias = rng.normal(size=NUM_GENRES)
    user_bias = rng.normal(scale=0.7, size=num_users + 1)
    users = rng.integers(1, num_users + 1, num_ratings)
    items = rng.integers(1, num_items + 1, num_ratings)
    score = (
        (u_vec[users] * i_vec[items]).sum(-1)
        + user_bias[users]
        + item_genres[items] @ genre_bias * 0.5
    )
    ratings = np.clip(np.round(3.3 + score + rng.normal(scale=0.8, size=num_ratings)), 1, 5).astype(
        int
    )
    times = 880_000_000 + np.sort(rng.integers(0, 20_000_000, num_ratings))
    lines = [
        f"{u}\t{i}\t{r}\t{t}" for u, i, r, t in zip(users, items, ratings, rng.permutation(times))
    ]
    (path / "u.data").write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="ml-100k directory")
    parser.add_argument(
        "--write-synthetic", metavar="DIR", help="write a tiny synthetic data set and exit"
    )
    args = parser.parse_args(argv)
    if args.write_synthetic:
        print(write_synthetic(args.write_synthetic))
        return 0
    print(json.dumps(load(args.data).summary(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
