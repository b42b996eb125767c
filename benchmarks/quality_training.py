"""Training on request-grouped batches for ``quality.py --trainer``: eager or through the compiler.

A training compile (``rocs.compile(..., training=True)``) computes the request side once per
request of a batch, so it trains on batches of whole requests (``request_batches``, RecD's
batching) in the shared layout: request features from one row per request, candidate features
and labels from every row, ``candidate_to_request`` mapping rows to requests.

What a request is on MovieLens. ``user_sparse`` is constant per user but ``history`` is not: it
holds the items the user rated strictly before the rating's timestamp, so it changes with every
rating time of the user. A request is therefore the distinct tuple of request features
(:func:`request_ids`), which on MovieLens-100K is a (user, timestamp) pair: about two ratings per
request. Grouping by user instead would give one request rows with different histories, and the
shared layout would feed them all the first row's history: a different model input, not a
different batching.

Identity the ``both`` comparison relies on: the eager model on the batch's rows (request
features replicated, as stored) and the compiled model on the same batch in the shared layout
compute the same loss for the same weights (``docs/contract.md``, "Training compiles": gradients
equal eager's up to re-association of sums). From the same initial weights and the same batches,
their per-step losses may then differ only by float re-association that Adam carries forward;
:func:`loss_gap` measures it over the first epoch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import rocs_compiler as rocs
from rocs_compiler.integrations.request_batches import RequestBatch, request_batches

GROUPED = ("eager_grouped", "rocs_grouped")
TRAINERS = {  # --trainer -> the trainings run per seed, the first one feeds the main tables
    "eager": ("eager_random",),
    "rocs": ("rocs_grouped",),
    "both": ("eager_random", "eager_grouped", "rocs_grouped"),
}


def request_ids(data: Mapping[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    """Per row, the id (int64 [n], 0..R-1) of its request: rows with equal values in every
    request input ``names`` share an id (the module docstring says why not the user id)."""
    n = data[names[0]].shape[0]
    columns = []
    for name in names:
        value = data[name].reshape(n, -1)
        # unique(dim=0) needs one dtype; floats compare by bits (equal features, equal bits)
        if value.is_floating_point():
            value = value.double().view(torch.int64)
        columns.append(value.to(torch.int64))
    _, inverse = torch.unique(torch.cat(columns, 1), dim=0, return_inverse=True)
    return inverse


def epoch_batches(
    ids: torch.Tensor, batch_size: int, window: int, generator: torch.Generator
) -> list[RequestBatch]:
    """One epoch of request-grouped batches of at most ``batch_size`` rows (every row once)."""
    return list(request_batches(ids, batch_size, window or ids.numel(), generator=generator))


def _shared_kwargs(data, batch: RequestBatch, features: Sequence[str], requests: Sequence[str]):
    kwargs = {name: data[name][batch.rows] for name in features if name not in requests}
    kwargs.update({name: data[name][batch.request_rows] for name in requests})
    return kwargs


def train_grouped(
    model: torch.nn.Module,
    data: Mapping[str, torch.Tensor],
    *,
    through: str,
    features: Sequence[str],
    requests: Sequence[str],
    example: Mapping[str, torch.Tensor],
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    window: int,
    progress: Callable[[int], Any],
) -> dict[str, Any]:
    """Adam on binary cross-entropy over request-grouped batches, in place on ``model``'s weights.

    ``through="eager"``: the model on the batch's rows; ``"rocs"``: a training compile of the
    model (from the replicated ``example``, compile time measured apart) in the shared layout.
    Both draw the same batches from ``seed``. Returns the training seconds (compile excluded),
    the compile seconds, the first epoch's per-step losses, the mean impressions per request of
    the batches and, for ``rocs``, the program each call bucket chose.
    """
    model.train()
    compile_seconds, cm = 0.0, None
    if through == "rocs":
        start = time.perf_counter()
        cm = rocs.compile(model, list(requests), example_kwargs=dict(example), training=True)
        compile_seconds = time.perf_counter() - start
    elif through != "eager":
        raise ValueError(f"through must be 'eager' or 'rocs', got {through!r}")
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    ids = request_ids(data, requests)
    g = torch.Generator().manual_seed(seed)
    rows = requests_seen = 0
    first_losses: list[float] = []
    bar = None
    start = time.perf_counter()
    for epoch in range(epochs):
        batches = epoch_batches(ids, batch_size, window, g)
        if bar is None:
            bar = progress(epochs * len(batches))
        for batch in batches:
            if cm is None:
                logits = model(**{name: data[name][batch.rows] for name in features})
            else:
                kwargs = _shared_kwargs(data, batch, features, requests)
                logits = cm(**kwargs, candidate_to_request=batch.candidate_to_request)
            loss = F.binary_cross_entropy_with_logits(logits, data["label"][batch.rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            value = loss.item()
            if epoch == 0:
                first_losses.append(value)
                rows += batch.rows.numel()
                requests_seen += batch.request_rows.numel()
            bar.update(f"loss {value:.4f}")
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    choices = {} if cm is None else {
        "/".join(map(str, key)): program for key, program in cm.program_choices().items()
    }  # fmt: skip
    return {
        "seconds": seconds,
        "compile_seconds": compile_seconds,
        "first_epoch_losses": first_losses,
        "impressions_per_request": rows / max(requests_seen, 1),
        "program_choices": choices,
    }


def loss_gap(a: Sequence[float], b: Sequence[float]) -> float:
    """Max abs difference of two trainings' per-step losses (inf when the step counts differ)."""
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


# -- output -----------------------------------------------------------------------------------------


def ideal_speedup(flops: Mapping[str, float], impressions_per_request: float) -> float:
    """Forward FLOPs per impression replicated over shared, ``k`` impressions per request:
    ``(C_req + C_cand) / (C_cand + C_req / k)`` (the FLOP report's split)."""
    request, candidate = flops["request"], flops["candidate"]
    return (request + candidate) / (candidate + request / impressions_per_request)


def _cell(stats: Mapping[str, Any] | None, key: str, fmt: str) -> str:
    return "" if stats is None else format(stats[key]["mean"], fmt)


def markdown_training(out: Mapping[str, Any]) -> str:
    """The table "Training through the compiled model": per variant, AUC and training seconds of
    each trainer run, the compiled model's speedup over eager on the same grouped batches."""
    seeds = len(out["config"]["seeds"])
    lines = [
        (
            f"| backbone | variant | AUC eager random | AUC eager grouped | AUC rocs grouped "
            f"(mean ± std, {seeds} seeds) | train s eager random | train s eager grouped | "
            "train s rocs grouped | rocs compile s | speedup rocs / eager grouped | "
            "impressions per request | ideal (forward FLOPs) | max abs loss diff, 1st step / "
            "1st epoch |"
        ),
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in out["results"]:
        t = r["trainers"]
        random, eager, compiled = (t.get(k) for k in ("eager_random", *GROUPED))

        def auc(stats):
            return "" if stats is None else (
                f"{stats['auc']['mean']:.4f} ± {stats['auc']['std']:.4f}"
            )  # fmt: skip

        speedup = (
            f"{eager['train_seconds']['mean'] / compiled['train_seconds']['mean']:.2f}x"
            if eager and compiled else ""
        )  # fmt: skip
        grouped = eager or compiled
        ideal = "" if grouped is None else (
            f"{ideal_speedup(r['flops'], grouped['impressions_per_request']):.2f}x"
        )  # fmt: skip
        gap = "" if r.get("loss_gap") is None else (
            f"{r['loss_gap_first_step']:.1e} / {r['loss_gap']:.1e}"
        )  # fmt: skip
        cells = [
            r["backbone"],
            r["variant"],
            auc(random),
            auc(eager),
            auc(compiled),
            _cell(random, "train_seconds", ".0f"),
            _cell(eager, "train_seconds", ".0f"),
            _cell(compiled, "train_seconds", ".0f"),
            _cell(compiled, "compile_seconds", ".1f"),
            speedup,
            "" if grouped is None else f"{grouped['impressions_per_request']:.2f}",
            ideal,
            gap,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
