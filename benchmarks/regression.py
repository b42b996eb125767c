"""No-regression benchmark: a compiled model is never slower than eager.

For every model (the zoo, the GLM and DCA versions of its interaction and sequence models, and
the models of ``regression_models.py``) and every cell (R requests, N candidates in total,
N / R per request), the script times

- ``eager``: ``model(**batch.replicated())``;
- ``shared``: ``cm(**batch.kwargs, candidate_to_request=idx)`` (request inputs with R rows);
- ``drop-in``: ``cm(**batch.replicated())`` (the original call; includes finding the requests),

(for the DeepCTR-Torch models and the torchfm-style models of ``torchfm_models.py``, whose one
packed input holds the request features as column ranges, the shared call passes it with its
request columns replicated, as they come),

where ``cm = rocs.compile(model, request_inputs, example_kwargs=<replicated batch of 2
requests with 4 and 3 candidates>)``, all under ``torch.no_grad()`` with one torch thread. It
prints a Markdown table of eager time / compiled time per model and cell, the cells below
``--threshold``, and a last line with the minimum ratio.

Noise control, for a shared machine: within a cell the three variants run round-robin, each
round starting from a different variant, so drift hits all of them alike; each sample is a loop
of calls long enough (``--sample-ms``) for the clock's resolution; the clock is the calling
thread's CPU time (``time.thread_time``; ``--clock wall`` for ``perf_counter``), which with one
torch thread counts the whole call and not the time the thread waited for a core; the reported
value is the median over ``--rounds`` rounds; and glibc's malloc is told to keep freed memory
(``allocator.py``; ``--malloc system`` leaves it as it is), so page faults on freshly mapped
blocks, which make a large call's time bimodal from one process to the next in eager and
compiled calls alike, do not decide a cell; and the whole measurement runs ``--passes`` (3)
times, each pass over every model with a fresh compile (so the program choice is measured again
too), a cell's ratio being the median of its passes: interference on a shared machine comes in
bursts of a second or two, long enough to move one cell of one pass by 10-40 % either way, and a
median of three passes taken minutes apart is not moved by one burst. Every single pass below
the threshold is listed after the table. Timing starts after warm-up calls in which the
compiled model settles on its program for the cell (option ``autotune``: the shared program or
the plain captured graph, whichever its first calls measured faster). Outputs are compared with
eager before and after the warm-up (``allclose``, rtol = atol = 1e-4), so both programs are
checked; a mismatch is printed and marks the cell with ``!``.

Usage::

    python benchmarks/regression.py                           # all models, all cells
    python benchmarks/regression.py --models dlrm crossmix --rounds 21
    python benchmarks/regression.py --quick --models no_share wide_deep   # smoke run
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree

import rocs_compiler as rocs
from models_zoo import ZOO
from models_zoo.batch import Batch, request_index
from allocator import retain_freed_memory
from regression_models import MODELS, make_inputs
import torchfm_models
from rocs_compiler.runtime.call.original_arm import ARM_TRIALS
from rocs_compiler.runtime.choice.program_choice import TRIALS

CELLS = ((1, 16), (1, 128), (1, 1024), (4, 16), (4, 128), (4, 1024))
QUICK_CELLS = ((1, 8), (2, 8))
LAYOUTS = ("shared", "dropin")
RTOL = ATOL = 1e-4
# Enough for every bucket to decide (option autotune), and for a bucket settled on the plain
# program to keep it or the original model (``runtime/call/original_arm.py``).
WARMUP_CALLS = 2 * TRIALS + 2 * ARM_TRIALS + 2


@dataclass(frozen=True)
class Case:
    """A benchmark model: ``build()`` gives it in eval mode, ``batch(counts)`` a shared-layout
    batch with ``counts[r]`` candidates for request r."""

    name: str
    build: Callable[[], nn.Module]
    request_inputs: tuple[str, ...]
    batch: Callable[[Sequence[int]], Batch]


def _zoo_case(name: str, transform: str = "") -> Case:
    entry = ZOO[name]

    def build() -> nn.Module:
        model = entry.build(seed=0)
        if transform == "glm":
            model = rocs.apply_glm(model, entry.request_inputs)
        elif transform == "dca":
            model = rocs.apply_dca(model, entry.request_inputs)
        return model.eval()

    label = f"{name}_{transform}" if transform else name
    return Case(label, build, tuple(entry.request_inputs), lambda counts: entry.make_batch(list(counts)))


def _model_case(name: str) -> Case:
    make, inputs = MODELS[name]
    requests = tuple(n for n in inputs if n.startswith("u"))

    def build() -> nn.Module:
        torch.manual_seed(0)
        return make().eval()

    def batch(counts: Sequence[int]) -> Batch:
        g = torch.Generator().manual_seed(1)
        kwargs = make_inputs(inputs, len(counts), sum(counts), g)
        return Batch(kwargs, request_index(counts), requests)

    return Case(name, build, requests, batch)


class _DeepCTRCase:
    """A DeepCTR-Torch model: one packed input ``X``, request features named by column range.
    Built on first use, so that runs without it never import DeepCTR (whose import starts a
    thread that prints a version notice)."""

    def __init__(self, name: str):
        self.name = f"deepctr_{name}"
        self._model_name = name

    @functools.cached_property
    def _case(self) -> Case:
        from models_zoo import deepctr_models

        model, user, _ = deepctr_models.build(self._model_name)

        def batch(counts: Sequence[int]) -> Batch:
            x, index = deepctr_models.draw(model, user, counts, seed=1)
            return Batch({"X": x}, index, ())  # request columns replicated in both layouts

        ranges = tuple(deepctr_models.request_ranges(model, user))
        return Case(self.name, lambda: deepctr_models.build(self._model_name)[0], ranges, batch)

    def __getattr__(self, field: str):
        return getattr(self._case, field)


def _deepctr_cases() -> list:
    if importlib.util.find_spec("deepctr_torch") is None:  # the ecosystem extra
        return []
    from models_zoo.deepctr_models import TINY

    return [_DeepCTRCase(name) for name in TINY]


def _torchfm_case(name: str) -> Case:
    """A torchfm-style model (``torchfm_models.py``): one packed ``x`` of field ids, the user
    fields a column range, replicated in both layouts."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return torchfm_models.MODELS[name]().eval()

    def batch(counts: Sequence[int]) -> Batch:
        x, index = torchfm_models.draw(counts, seed=1)
        return Batch({"x": x}, index, ())

    return Case(f"torchfm_{name}", build, torchfm_models.REQUEST, batch)


def all_cases() -> dict[str, Case]:
    cases = [_zoo_case(name) for name in ZOO]
    cases += [_zoo_case(name, "glm") for name in ("dcnv2", "finalmlp", "wukong")]
    cases += [_zoo_case(name, "dca") for name in ("bst", "hstu")]
    cases += [_model_case(name) for name in MODELS]
    cases += [_torchfm_case(name) for name in ("lr", "fm")]
    cases += _deepctr_cases()
    return {c.name: c for c in cases}


# -- timing ---------------------------------------------------------------------------------------


def time_interleaved(
    calls: dict[str, Callable[[], object]], rounds: int, sample_s: float, clock: Callable[[], float]
) -> dict[str, float]:
    """Median seconds per call of each of ``calls``, run round-robin (see the module docstring)."""
    loops = {}
    for name, call in calls.items():
        start = clock()
        call()
        loops[name] = max(1, math.ceil(sample_s / max(clock() - start, 1e-7)))
    names = list(calls)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            call, n = calls[name], loops[name]
            start = clock()
            for _ in range(n):
                call()
            samples[name].append((clock() - start) / n)
    return {n: statistics.median(v) for n, v in samples.items()}


def _matches(reference, output) -> bool:
    ref, out = pytree.tree_leaves(reference), pytree.tree_leaves(output)
    return len(ref) == len(out) and all(
        torch.allclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=True) for a, b in zip(ref, out)
    )


def measure_case(case: Case, cells, rounds: int, sample_s: float, clock) -> dict:
    """``{(R, N): {"eager": s, "shared": s, "dropin": s, "mismatch": [layouts]}}`` for ``case``."""
    model = case.build()
    example = case.batch([4, 3]).replicated()
    cm = rocs.compile(model, list(case.request_inputs), example_kwargs=example)
    results = {}
    for requests, candidates in cells:
        batch = case.batch([candidates // requests] * requests)
        replicated, kwargs, index = batch.replicated(), batch.kwargs, batch.candidate_to_request
        calls = {
            "eager": lambda: model(**replicated),
            "shared": lambda: cm(**kwargs, candidate_to_request=index),
            "dropin": lambda: cm(**replicated),
        }
        reference = calls["eager"]()
        mismatch = {layout for layout in LAYOUTS if not _matches(reference, calls[layout]())}
        for _ in range(WARMUP_CALLS):  # the compiled model picks its program per bucket
            for layout in LAYOUTS:
                calls[layout]()
        mismatch |= {layout for layout in LAYOUTS if not _matches(reference, calls[layout]())}
        cell = time_interleaved(calls, rounds, sample_s, clock)
        cell["mismatch"] = sorted(mismatch)
        results[(requests, candidates)] = cell
    return results


# -- report ---------------------------------------------------------------------------------------


def combine(passes: list[dict]) -> dict:
    """``{model: {(R, N): {"ratios": {layout: [eager / compiled per pass]}, "mismatch": [...]}}}``
    from the per-pass results of :func:`measure_case`."""
    combined: dict = {}
    for results in passes:
        for model, cells in results.items():
            for cell, t in cells.items():
                entry = combined.setdefault(model, {}).setdefault(
                    cell, {"ratios": {layout: [] for layout in LAYOUTS}, "mismatch": set()}
                )
                for layout in LAYOUTS:
                    entry["ratios"][layout].append(t["eager"] / t[layout])
                entry["mismatch"].update(t["mismatch"])
    return combined


def ratios(combined: dict) -> list[tuple[str, int, int, str, float]]:
    """(model, R, N, layout, median over passes of eager time / compiled time) per cell."""
    rows = []
    for model, cells in combined.items():
        for (requests, candidates), entry in cells.items():
            for layout in LAYOUTS:
                median = statistics.median(entry["ratios"][layout])
                rows.append((model, requests, candidates, layout, median))
    return rows


def markdown_table(combined: dict, cells) -> str:
    head = ["model"] + [
        f"R={r} N={n} {'shared' if layout == 'shared' else 'drop-in'}"
        for r, n in cells
        for layout in LAYOUTS
    ]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for model, measured in combined.items():
        row = [model]
        for cell in cells:
            entry = measured[cell]
            for layout in LAYOUTS:
                mark = "!" if layout in entry["mismatch"] else ""
                row.append(f"{statistics.median(entry['ratios'][layout]):.2f}{mark}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def summary(combined: dict, threshold: float) -> list[str]:
    rows = ratios(combined)
    lines = []
    below = sorted((r for r in rows if r[4] < threshold), key=lambda r: r[4])
    for model, requests, candidates, layout, ratio in below:
        lines.append(f"below {threshold}: {model} R={requests} N={candidates} {layout} {ratio:.2f}")
    passes = max(len(e["ratios"][LAYOUTS[0]]) for cells in combined.values() for e in cells.values())
    if passes > 1:  # every single measurement below the threshold, for the record
        for model, cells in combined.items():
            for (requests, candidates), entry in cells.items():
                for layout in LAYOUTS:
                    seen = entry["ratios"][layout]
                    if min(seen) < threshold:
                        values = ", ".join(f"{r:.2f}" for r in seen)
                        lines.append(
                            f"one pass below {threshold}: {model} R={requests} N={candidates} "
                            f"{layout} ({values})"
                        )
    for model, cells in combined.items():
        for (requests, candidates), entry in cells.items():
            for layout in sorted(entry["mismatch"]):
                lines.append(f"MISMATCH: {model} R={requests} N={candidates} {layout} differs from eager")
    model, requests, candidates, layout, ratio = min(rows, key=lambda r: r[4])
    lines.append(f"minimum ratio: {ratio:.2f} ({model}, R={requests}, N={candidates}, {layout})")
    return lines


# -- command line ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", help="model names (default: all)")
    parser.add_argument("--quick", action="store_true", help="tiny cells, 2 rounds (smoke run)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per cell")
    parser.add_argument(
        "--passes", type=int, default=3, help="independent passes over all models; a cell's "
        "ratio is the median of its passes",
    )
    parser.add_argument("--sample-ms", type=float, default=5.0, help="minimum time per sample")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="thread CPU or wall time")
    parser.add_argument("--threshold", type=float, default=0.97, help="list cells below this ratio")
    parser.add_argument("--markdown", help="also write the table and summary to this file")
    parser.add_argument(
        "--malloc", choices=("retain", "system"), default="retain",
        help="keep freed memory in the process (default) or leave glibc's malloc as it is",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.sample_ms, args.passes = 2, 0.0, 1
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.malloc == "retain" and not retain_freed_memory():
        print("[regression] malloc is not glibc's: --malloc retain has no effect", file=sys.stderr)
    cases = all_cases()
    names = args.models or list(cases)
    unknown = [n for n in names if n not in cases]
    if unknown:
        print(f"unknown model(s) {unknown}; known: {', '.join(cases)}", file=sys.stderr)
        return 2
    cells = QUICK_CELLS if args.quick else CELLS
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    passes = []
    with torch.no_grad():
        for number in range(1, args.passes + 1):
            results = {}
            for name in names:  # a fresh compile per pass: the program choice is measured again
                started = time.perf_counter()
                results[name] = measure_case(cases[name], cells, args.rounds, args.sample_ms / 1e3, clock)
                took = time.perf_counter() - started
                print(f"[regression] pass {number}/{args.passes} {name}: {took:.1f} s",
                      file=sys.stderr, flush=True)  # fmt: skip
            passes.append(results)
    combined = combine(passes)
    text = "\n".join([markdown_table(combined, cells), "", *summary(combined, args.threshold)])
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
