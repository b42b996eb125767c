"""Quality benchmark: vanilla vs ROCS-modified models on MovieLens-100K.

For each interaction backbone (DCNv2, FinalMLP, Wukong) three variants are trained from the same
seeds:

- ``vanilla``: the backbone as written (``models_zoo.backbones``);
- ``rocs_base``: ``apply_glm(vanilla, request_fraction=0.5)``, same layer widths, half of every
  hidden layer a request-only lane group;
- ``rocs_scaled``: ``apply_glm(vanilla, request_fraction=0.5, request_scale=s)`` with the request
  lanes widened ``s`` times, ``s`` the largest value (searched on the compiler's FLOP report, at
  most ``--max-scale``) whose amortized cost at N = 100 does not exceed vanilla's.

For the sequence backbone: ``vanilla`` (candidate appended to the history, BST-style) and
``dca`` (``apply_dca``: history stack per request, the candidate cross-attends).

Two more backbones are written as a user would (``models_zoo.user_models``, no registered
family), so the transforms take their generic paths, given one example batch:

- ``ranker``: the GLM issue's ``Ranker`` behind field embeddings (``FieldRanker``), with the
  same three variants as the interaction backbones;
- ``bst_like``: an ``nn.TransformerEncoder`` over ``[history; candidate field tokens]``
  (``BSTLike``): ``vanilla``, ``dca`` (``apply_dca``, history length from lineage) and
  ``dca_scaled`` (``apply_glm`` with ``request_scale = s`` on the DCA model: the head MLP's
  request lanes widened, ``s`` searched as for ``rocs_scaled``).

Per variant it reports test AUC and LogLoss (mean and sample std over the seeds); from the first
seed's trained model, compiled with ``rocs.compile``: FLOPs per request and per candidate and the
amortized FLOPs per candidate ``C_cand + C_req / N`` at N = 1 and N = 100
(``report.amortized_flops``); and measured inference time for one request with N = 100 and 1000
candidates, eager on replicated inputs vs the compiled model in shared layout (median of
``--speed-repeats`` interleaved calls, after a check that both agree).

Training: by default (``--trainer eager``) Adam on random row batches, eager. ``--trainer rocs``
trains instead through a training compile (``rocs.compile(..., training=True)``) in the shared
layout on batches of whole requests (``quality_training.py`` says what a request is here);
``--trainer both`` runs both and eager on the same request-grouped batches, to separate the
effect of the batching from the compiler's, and prints a third table, "Training through the
compiled model" (AUC and training seconds per trainer). Cost, speed and the first two tables come
from the first trainer (eager on random batches, unless ``--trainer rocs``).

Usage::

    python benchmarks/quality.py                      # full run, Markdown table on stdout
    python benchmarks/quality.py --json results.json  # also write every number as JSON
    python benchmarks/quality.py --quick --json q.json  # tiny synthetic data, about a minute
    python benchmarks/quality.py --trainer both --models dcnv2  # + training through rocs
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import movielens
import quality_training as qt

import rocs_compiler as rocs
from models_zoo import backbones as bb
from models_zoo import user_models

SYNTHETIC = movielens.REPO_ROOT / "tests" / "data" / "ml-synthetic"
BACKBONE_NAMES = ("dcnv2", "finalmlp", "wukong", "sequence", "ranker", "bst_like")
# --quick: one backbone per path (a zoo model through GLM and through DCA, a user's through each)
QUICK_BACKBONES = ("dcnv2", "sequence", "ranker", "bst_like")
USER_BACKBONES = ("ranker", "bst_like")  # user-written: the transforms' generic paths
SPEED_CANDIDATES = (100, 1000)
# Request-scale caps below --max-scale, by backbone: the Ranker's hidden layers are 512 and 256
# wide, so s = 16 makes a 4096 x 4352 request block that trains for 50 minutes per seed on two
# CPU cores; s = 4 keeps its training within 3x vanilla's.
SCALE_CAPS = {"ranker": 4.0}
RTOL, ATOL = 1e-4, 1e-4


# -- configuration ----------------------------------------------------------------------------------


def backbone_config(name: str, emb_dim: int, quick: bool) -> dict[str, Any]:
    """Constructor arguments of each backbone (small: the benchmark trains on two CPU cores)."""
    if quick:
        return {
            "dcnv2": {"emb_dim": emb_dim, "num_cross": 1, "rank": 8, "deep": (32, 16)},
            "finalmlp": {
                "emb_dim": emb_dim, "stream1": (32, 16), "stream2": (32, 16),
                "num_heads": 2, "gate_hidden": 16,
            },
            "wukong": {"emb_dim": emb_dim, "layers": ((2, 2),), "fmb_hidden": 16, "head": (32,)},
            "sequence": {"emb_dim": emb_dim, "heads": 2, "ffn": 16, "num_layers": 1, "head": (16,)},
            "ranker": {"dim": emb_dim, "user_hidden": 32, "item_hidden": 16, "hidden": (32, 16)},
            "bst_like": {"dim": emb_dim, "heads": 2, "ffn": 16, "layers": 1, "head": (16,)},
        }[name]
    return {
        "dcnv2": {"emb_dim": emb_dim, "num_cross": 2, "rank": 16, "deep": (128, 64)},
        "finalmlp": {
            "emb_dim": emb_dim, "stream1": (128, 64), "stream2": (128, 64),
            "num_heads": 4, "gate_hidden": 64,
        },
        "wukong": {
            "emb_dim": emb_dim, "layers": ((4, 4), (4, 4)), "fmb_hidden": 64, "head": (128, 64),
        },
        "sequence": {"emb_dim": emb_dim, "heads": 2, "ffn": 32, "num_layers": 2, "head": (64,)},
        # the GLM issue's Ranker sizes (user tower 256, item tower 64, MLP 512-256-1)
        "ranker": {"dim": emb_dim, "user_hidden": 256, "item_hidden": 64, "hidden": (512, 256)},
        "bst_like": {"dim": emb_dim, "heads": 2, "ffn": 32, "layers": 2, "head": (64,)},
    }[name]


def build_backbone(name: str, schema, config: dict) -> torch.nn.Module:
    """A vanilla backbone: a zoo backbone, or a user-written model over the same inputs."""
    if name not in USER_BACKBONES:
        return bb.BACKBONES[name](schema, **config)
    fields = (schema.request_vocabs, schema.num_items, schema.candidate_vocabs, schema.multihot)
    if name == "ranker":
        return user_models.FieldRanker(*fields, **config)
    return user_models.BSTLike(*fields, schema.history_length, **config)


@dataclass(frozen=True)
class Variant:
    backbone: str
    name: str  # vanilla | rocs_base | rocs_scaled | dca | dca_scaled
    request_scale: float | None = None

    def build(self, schema, config: dict, seed: int, example: dict) -> torch.nn.Module:
        """The variant's model with weights drawn from ``seed`` (vanilla first, then transformed).

        ``example`` (a replicated batch) is for the user-written backbones, whose transforms
        capture the model to find its lanes and history positions."""
        torch.manual_seed(seed)
        model = build_backbone(self.backbone, schema, config)
        given = {"example_kwargs": example} if self.backbone in USER_BACKBONES else {}
        if self.name.startswith("dca"):
            model = rocs.apply_dca(model, bb.REQUEST_INPUTS, **given)
        if self.name.startswith("rocs") or self.name == "dca_scaled":
            scale = self.request_scale or 1.0
            model = rocs.apply_glm(model, bb.REQUEST_INPUTS, 0.5, scale, **given)
        return model


# -- progress ---------------------------------------------------------------------------------------


class Progress:
    """A progress bar on stderr: tqdm when installed, else a line every ~10% of the steps."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.enabled, self.done = total, label, enabled, 0
        self._bar, self._next = None, 0
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=label, file=sys.stderr, dynamic_ncols=True, leave=False
            )
        except ImportError:
            pass

    def update(self, postfix: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            if postfix:
                self._bar.set_postfix_str(postfix, refresh=False)
        elif self.done >= self._next or self.done == self.total:
            print(
                f"  {self.label}: {self.done}/{self.total} {postfix}", file=sys.stderr, flush=True
            )
            self._next = self.done + max(1, self.total // 10)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def note(message: str, enabled: bool = True) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)


# -- training and evaluation -----------------------------------------------------------------------


def features(split: dict[str, torch.Tensor], rows) -> dict[str, torch.Tensor]:
    return {name: split[name][rows] for name in movielens.FEATURES}


def train(
    model, data: dict, *, epochs: int, batch_size: int, lr: float, seed: int, label: str, show: bool
) -> float:
    """Adam on binary cross-entropy; returns the wall time in seconds."""
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    n = data["label"].numel()
    steps = math.ceil(n / batch_size)
    bar = Progress(epochs * steps, label, show)
    start = time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(n, generator=g)
        for k in range(steps):
            rows = order[k * batch_size : (k + 1) * batch_size]
            loss = F.binary_cross_entropy_with_logits(
                model(**features(data, rows)), data["label"][rows]
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            bar.update(f"loss {loss.item():.4f}")
    bar.close()
    return time.perf_counter() - start


@torch.no_grad()
def predict(model, data: dict, batch_size: int = 4096) -> torch.Tensor:
    model.eval()
    n = data["label"].numel()
    return torch.cat(
        [model(**features(data, slice(i, i + batch_size))) for i in range(0, n, batch_size)]
    )


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties)."""
    scores, labels = scores.double(), labels.bool()
    positives = int(labels.sum())
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    average_rank = ends - (counts.double() - 1) / 2  # 1-based rank of each distinct value
    rank_sum = average_rank[inverse][labels].sum().item()
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def logloss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return F.binary_cross_entropy_with_logits(logits.double(), labels.double()).item()


# -- cost and speed ---------------------------------------------------------------------------------


def example_batch(data: dict, counts=(3, 2)) -> dict[str, torch.Tensor]:
    """A replicated example batch: requests from the first rows, candidates from the next."""
    n = sum(counts)
    request_rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    kwargs = features(data, torch.arange(n))
    for name in movielens.REQUEST_INPUTS:
        kwargs[name] = data[name][request_rows]
    return kwargs


def compile_model(model, data: dict):
    model.eval()
    return rocs.compile(model, list(movielens.REQUEST_INPUTS), example_kwargs=example_batch(data))


def flop_summary(cm) -> dict[str, float]:
    report = cm.report(candidates=100)
    return {
        "request": report.request_flops,
        "candidate": report.candidate_flops,
        "amortized_n1": report.amortized_flops(1),
        "amortized_n100": report.amortized_flops(100),
        "fallbacks": [
            f"{f.node} ({f.op}) in {f.module or '-'}: {f.reason}" for f in report.fallbacks
        ],
    }


def serving_batch(ml: movielens.MovieLens, num_candidates: int, seed: int = 0):
    """One test request (a user with a non-empty history) and ``num_candidates`` items."""
    g = torch.Generator().manual_seed(seed)
    test = ml.test
    with_history = torch.nonzero(test["history"][:, 5] != 0).flatten()
    pool = with_history if with_history.numel() else torch.arange(test["label"].numel())
    row = pool[torch.randint(pool.numel(), (1,), generator=g)]
    items = torch.randint(1, ml.num_items + 1, (num_candidates,), generator=g)
    shared = {name: test[name][row] for name in movielens.REQUEST_INPUTS}
    shared["item_sparse"] = ml.items["item_sparse"][items]
    shared["item_multihot"] = ml.items["item_multihot"][items]
    replicated = dict(shared)
    for name in movielens.REQUEST_INPUTS:
        replicated[name] = shared[name].expand(num_candidates, *shared[name].shape[1:]).contiguous()
    return shared, replicated


def median_times(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds per call; calls interleaved round-robin after one warm-up each."""
    samples = {name: [] for name in fns}
    with torch.no_grad():
        for fn in fns.values():
            fn()
        for k in range(repeats):
            names = list(fns)
            names = names[k % len(names) :] + names[: k % len(names)]
            for name in names:
                start = time.perf_counter()
                fns[name]()
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def measure_speed(model, cm, ml: movielens.MovieLens, repeats: int) -> dict[str, Any]:
    out = {}
    report = cm.report(candidates=1)
    for n in SPEED_CANDIDATES:
        shared, replicated = serving_batch(ml, n)
        index = torch.zeros(n, dtype=torch.int64)
        with torch.no_grad():
            expected = model(**replicated)
            got = cm(**shared, candidate_to_request=index)
        error = float((got - expected).abs().max())
        calls = {
            "eager_replicated": functools.partial(model, **replicated),
            "rocs_shared": functools.partial(cm, **shared, candidate_to_request=index),
        }
        times = median_times(calls, repeats)
        out[str(n)] = {
            "eager_ms": times["eager_replicated"] * 1e3,
            "rocs_ms": times["rocs_shared"] * 1e3,
            "speedup": times["eager_replicated"] / times["rocs_shared"],
            "ideal_speedup": report.ideal_speedup(n, 1),
            "max_abs_err": error,
            "allclose": bool(torch.allclose(got, expected, rtol=RTOL, atol=ATOL)),
        }
    return out


def search_scale(
    variant_of: Callable[[float], Any], target: float, max_scale: float, steps: int
) -> tuple[float, float]:
    """Largest request scale in [1, max_scale] whose amortized FLOPs at N = 100 stay <= target.

    Amortized cost grows with the scale; bisection on a log scale over ``steps`` compiles (with
    one step: ``max_scale`` as is). Returns (scale, its amortized FLOPs at N = 100).
    """

    hi_cost = variant_of(max_scale)
    if hi_cost <= target or steps <= 1:
        return max_scale, hi_cost
    lo, lo_cost, hi = 1.0, variant_of(1.0), max_scale
    for _ in range(steps - 2):
        mid = math.sqrt(lo * hi)
        mid_cost = variant_of(mid)
        if mid_cost <= target:
            lo, lo_cost = mid, mid_cost
        else:
            hi = mid
    return lo, lo_cost


# -- the benchmark ----------------------------------------------------------------------------------


def variants_of(backbone: str) -> list[str]:
    if backbone == "sequence":
        return ["vanilla", "dca"]
    if backbone == "bst_like":
        return ["vanilla", "dca", "dca_scaled"]
    return ["vanilla", "rocs_base", "rocs_scaled"]


def mean_std(values: list[float]) -> dict[str, Any]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "per_seed": values,
    }


def choose_scale(
    backbone: str, name: str, schema, config: dict, ml, target: float, args
) -> tuple[float, dict]:
    """The scaled variant's request scale (see :func:`search_scale`) and a record of the search."""

    def amortized(scale: float) -> float:
        model = Variant(backbone, name, scale).build(schema, config, 0, example_batch(ml.train))
        return compile_model(model, ml.train).report(100, 1).amortized_flops(100)

    start = time.perf_counter()
    cap = min(args.max_scale, SCALE_CAPS.get(backbone, args.max_scale))
    if args.search_steps <= 1:  # no search: the cap, costed later by the variant's own compile
        return cap, {"target_amortized_n100": target, "amortized_n100": None, "seconds": 0.0,
                     "max_scale": cap}  # fmt: skip
    scale, cost = search_scale(amortized, target, cap, args.search_steps)
    return scale, {
        "target_amortized_n100": target,
        "amortized_n100": cost,
        "seconds": time.perf_counter() - start,
        "max_scale": cap,
    }


def run_variant(variant: Variant, schema, config: dict, ml, args, show: bool) -> dict[str, Any]:
    """Train and test one variant on every seed with each trainer of ``--trainer``; cost and speed
    from the first seed's model of the first trainer, whose numbers fill the main tables."""
    entry: dict[str, Any] = {
        "backbone": variant.backbone,
        "variant": variant.name,
        "request_scale": variant.request_scale,
        "config": config,
    }
    trainings = qt.TRAINERS[args.trainer]
    runs: dict[str, list[dict]] = {kind: [] for kind in trainings}
    for i, seed in enumerate(args.seeds):
        example = example_batch(ml.train)
        for k, kind in enumerate(trainings):
            model = variant.build(schema, config, seed, example)
            label = f"{variant.backbone}/{variant.name} seed {seed}"
            label += "" if args.trainer == "eager" else f" {kind}"
            record = train_with(kind, model, ml.train, example, seed, args, label, show)
            logits = predict(model, ml.test)
            record["auc"] = auc(logits, ml.test["label"])
            record["logloss"] = logloss(logits, ml.test["label"])
            runs[kind].append(record)
            note(
                f"{label}: AUC {record['auc']:.4f} LogLoss {record['logloss']:.4f} "
                f"({record['seconds']:.0f}s)",
                show,
            )
            if i == 0 and k == 0:
                entry["parameters"] = sum(p.numel() for p in model.parameters())
                cm = compile_model(model, ml.train)
                entry["flops"] = flop_summary(cm)
                entry["speed"] = measure_speed(model.eval(), cm, ml, args.speed_repeats)
        if all(kind in runs for kind in qt.GROUPED):
            gap = qt.loss_gap(*(runs[kind][-1]["first_epoch_losses"] for kind in qt.GROUPED))
            note(f"{variant.backbone}/{variant.name} seed {seed}: first-epoch losses of eager and "
                 f"rocs on the same grouped batches differ by at most {gap:.2e}", show)  # fmt: skip
    entry["trainers"] = {kind: trainer_summary(records) for kind, records in runs.items()}
    primary = entry["trainers"][trainings[0]]
    for key in ("auc", "logloss", "train_seconds"):
        entry[key] = primary[key]
    if all(kind in runs for kind in qt.GROUPED):
        pairs = list(zip(*(runs[kind] for kind in qt.GROUPED)))
        gaps = [qt.loss_gap(a["first_epoch_losses"], b["first_epoch_losses"]) for a, b in pairs]
        entry["loss_gap_per_seed"] = gaps
        entry["loss_gap"] = max(gaps)
        entry["loss_gap_first_step"] = max(
            qt.loss_gap(a["first_epoch_losses"][:1], b["first_epoch_losses"][:1]) for a, b in pairs
        )
    return entry


def train_with(kind: str, model, data: dict, example: dict, seed: int, args, label: str, show):
    """One training of ``kind`` (a name in ``quality_training.TRAINERS``); its record."""
    fit = {"epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "seed": seed}
    if kind == "eager_random":
        return {"seconds": train(model, data, **fit, label=label, show=show)}
    return qt.train_grouped(
        model, data, through=kind.split("_")[0], features=movielens.FEATURES,
        requests=movielens.REQUEST_INPUTS, example=example, window=args.window,
        progress=functools.partial(progress_bar, label=label, show=show), **fit,
    )  # fmt: skip


def progress_bar(total: int, *, label: str, show: bool) -> Progress:
    return Progress(total, label, show)


def trainer_summary(records: list[dict]) -> dict[str, Any]:
    """One trainer's numbers over the seeds (a JSON field of the variant's entry)."""
    out = {
        "auc": mean_std([r["auc"] for r in records]),
        "logloss": mean_std([r["logloss"] for r in records]),
        "train_seconds": mean_std([r["seconds"] for r in records]),
    }
    if "first_epoch_losses" in records[0]:  # a grouped trainer
        out["compile_seconds"] = mean_std([r["compile_seconds"] for r in records])
        out["impressions_per_request"] = statistics.fmean(
            r["impressions_per_request"] for r in records
        )
        out["first_epoch_losses"] = [r["first_epoch_losses"] for r in records]
        out["program_choices"] = [r["program_choices"] for r in records]
    return out


def run(args) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    show = not args.no_progress
    ml = movielens.load(args.data)
    schema = ml.schema
    note(f"data: {json.dumps(ml.summary())}", show)
    results = []
    for backbone in args.models:
        config = backbone_config(backbone, args.emb_dim, args.quick)
        vanilla: dict[str, float] = {}
        for name in variants_of(backbone):
            variant, search = Variant(backbone, name), None
            if name.endswith("_scaled"):
                target = vanilla["amortized_n100"]
                scale, search = choose_scale(backbone, name, schema, config, ml, target, args)
                variant = Variant(backbone, name, scale)
            entry = run_variant(variant, schema, config, ml, args, show)
            if search is not None:
                if search["amortized_n100"] is None:
                    search["amortized_n100"] = entry["flops"]["amortized_n100"]
                cost, target = search["amortized_n100"], search["target_amortized_n100"]
                note(
                    f"{backbone}/{name}: request_scale {variant.request_scale:.2f} (amortized "
                    f"N=100 {cost:.0f} vs vanilla {target:.0f})",
                    show,
                )
            entry["scale_search"] = search
            flops = entry["flops"]
            if name == "vanilla":
                vanilla = dict(flops, auc=entry["auc"]["per_seed"])
            deltas = [a - b for a, b in zip(entry["auc"]["per_seed"], vanilla["auc"])]
            entry["auc_delta_vs_vanilla"] = mean_std(deltas)
            flops["reduction_n100_vs_vanilla"] = (
                1 - flops["amortized_n100"] / vanilla["amortized_n100"]
            )
            flops["ratio_n1_vs_vanilla"] = flops["amortized_n1"] / vanilla["amortized_n1"]
            results.append(entry)
    return {
        "command": " ".join(["python", "benchmarks/quality.py", *map(shlex.quote, sys.argv[1:])]),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "threads": args.threads,
        },
        "data": ml.summary(),
        "results": results,
    }


# -- output -----------------------------------------------------------------------------------------


def _fmt_flops(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.0f}"


def markdown(out: dict[str, Any]) -> str:
    seeds = len(out["config"]["seeds"])
    lines = [
        (
            f"| backbone | variant | scale | AUC (mean ± std, {seeds} seeds) | ΔAUC vs vanilla "
            "(paired by seed) | LogLoss | FLOPs/cand N=1 | FLOPs/cand N=100 | vs vanilla N=100 | "
            "eager / rocs ms N=100 | eager / rocs ms N=1000 |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["results"]:
        f, s = r["flops"], r["speed"]
        scale = "" if r["request_scale"] is None else f"{r['request_scale']:.2f}"
        change = (
            "" if r["variant"] == "vanilla" else f"{-100 * f['reduction_n100_vs_vanilla']:+.1f}%"
        )
        speed = [
            f"{s[k]['eager_ms']:.2f} / {s[k]['rocs_ms']:.2f} ({s[k]['speedup']:.1f}x)"
            for k in ("100", "1000")
        ]
        d = r["auc_delta_vs_vanilla"]
        delta = "" if r["variant"] == "vanilla" else f"{d['mean']:+.4f} ± {d['std']:.4f}"
        cells = [
            r["backbone"],
            r["variant"],
            scale,
            f"{r['auc']['mean']:.4f} ± {r['auc']['std']:.4f}",
            delta,
            f"{r['logloss']['mean']:.4f} ± {r['logloss']['std']:.4f}",
            _fmt_flops(f["amortized_n1"]),
            _fmt_flops(f["amortized_n100"]),
            change,
            *speed,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_details(out: dict[str, Any]) -> str:
    """Per seed, with model size, training time and the FLOP report's split."""
    lines = [
        ("| backbone | variant | parameters | AUC per seed | train s | C_req | C_cand | "
        "N=1 cost vs vanilla | ideal speedup N=100 / 1000 |"),
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in out["results"]:
        f, s = r["flops"], r["speed"]
        cells = [
            r["backbone"],
            r["variant"],
            f"{r['parameters']:,}",
            " / ".join(f"{a:.4f}" for a in r["auc"]["per_seed"]),
            f"{r['train_seconds']['mean']:.0f}",
            f"{f['request']:,.0f}",
            f"{f['candidate']:,.0f}",
            f"{f['ratio_n1_vs_vanilla']:.2f}",
            f"{s['100']['ideal_speedup']:.1f} / {s['1000']['ideal_speedup']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        description="MovieLens-100K quality benchmark: vanilla vs ROCS"
    )
    parser.add_argument("--data", default=str(movielens.DEFAULT_DATA), help="ml-100k directory")
    parser.add_argument(
        "--models", nargs="+", choices=BACKBONE_NAMES,
        help="backbones (default: all; with --quick: " + ", ".join(QUICK_BACKBONES) + ")",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--emb-dim", type=int, default=16)
    parser.add_argument(
        "--max-scale", type=float, default=16.0, help="cap on the scaled variant's request_scale"
    )
    parser.add_argument(
        "--search-steps", type=int, default=6, help="compiles spent on the scale search"
    )
    parser.add_argument("--speed-repeats", type=int, default=31)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--trainer", choices=tuple(qt.TRAINERS), default="eager",
        help="eager: Adam on random row batches (the main tables); rocs: through a training "
        "compile on request-grouped batches; both: those two and eager on the grouped batches",
    )  # fmt: skip
    parser.add_argument(
        "--window", type=int, default=0,
        help="rows per shuffle window of the request-grouped batches (0: the whole split)",
    )  # fmt: skip
    parser.add_argument("--json", help="write the results as JSON to this file")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny synthetic data and models (tests/data/ml-synthetic), 2 seeds, 1 epoch",
    )
    args = parser.parse_args(argv)
    if args.models is None:
        args.models = list(QUICK_BACKBONES if args.quick else BACKBONE_NAMES)
    if args.quick:
        args.seeds = args.seeds[:2] if args.seeds != [0, 1, 2] else [0, 1]
        args.epochs, args.emb_dim, args.speed_repeats, args.search_steps = 1, 8, 3, 1
        args.max_scale = min(args.max_scale, 4.0)
        if args.data == str(movielens.DEFAULT_DATA):
            args.data = str(
                SYNTHETIC
                if (SYNTHETIC / "u.data").exists()
                else movielens.write_synthetic(Path(tempfile.mkdtemp()) / "ml-synthetic")
            )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(markdown(out))
    print()
    print(markdown_details(out))
    if args.trainer != "eager":
        print()
        print(qt.markdown_training(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
