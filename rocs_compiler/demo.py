"""Demo: compile zoo models, print a report and a side-by-side speed comparison.

Run with ``python -m rocs_compiler.demo [MODEL ...]``.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import rocs_compiler as rocs
from rocs_compiler.timing import median_ms


_COLUMNS = ("model", "eager ms", "rocs ms", "drop-in ms", "speedup", "ideal", "exact")


def speed_table(rows) -> list[str]:
    """The speed table's lines: a header and one line per ``(name, eager_ms, shared_ms,
    dropin_ms, ideal, exact)``, every column as wide as its widest cell (names left-aligned,
    numbers right-aligned)."""
    cells = [
        (name, f"{eager:.2f}", f"{shared:.2f}", f"{dropin:.2f}", f"{eager / shared:.2f}x",
         f"{ideal:.2f}x", "yes" if exact else "NO")
        for name, eager, shared, dropin, ideal, exact in rows
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in [_COLUMNS, *cells]) for i in range(len(_COLUMNS))]

    def line(row) -> str:
        name, *numbers, exact = row
        middle = [f"{cell:>{width}}" for cell, width in zip(numbers, widths[1:-1])]
        return "  ".join([f"{name:<{widths[0]}}", *middle, exact]).rstrip()

    return [line(row) for row in [_COLUMNS, *cells]]


def main(argv=None) -> int:
    from models_zoo import ZOO

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("models", nargs="*", default=["target_attention", "two_tower", "dlrm"])
    parser.add_argument("--candidates", type=int, default=1024, help="candidates per request")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch threads (default 1: stable timings on a shared machine)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    rows = []
    for name in args.models:
        entry = ZOO[name]
        model = entry.build(0)
        start = time.perf_counter()
        compiled = rocs.compile(
            model, entry.request_inputs, example_kwargs=entry.make_batch([4, 3]).replicated()
        )
        compile_s = time.perf_counter() - start
        report = compiled.report(candidates=args.candidates)
        print(f"\n=== {name}: {entry.description} (compiled in {compile_s:.1f} s) ===")
        print(report.to_text(max_rows=25))
        batch = entry.make_batch([args.candidates], seed=1)
        replicated = batch.replicated()
        with torch.no_grad():
            expected = model(**replicated)
        shared = compiled(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
        exact = all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-5)
            for a, b in zip(torch.utils._pytree.tree_leaves(shared), torch.utils._pytree.tree_leaves(expected))
        )
        with torch.no_grad():
            eager_ms = median_ms(lambda: model(**replicated), args.repeats)
        shared_ms = median_ms(
            lambda: compiled(**batch.kwargs, candidate_to_request=batch.candidate_to_request),
            args.repeats,
        )
        dropin_ms = median_ms(lambda: compiled(**replicated), args.repeats)
        rows.append((name, eager_ms, shared_ms, dropin_ms, report.ideal_speedup(), exact))
    print(
        f"\nSpeed at R=1 request x N={args.candidates} candidates "
        f"(median of {args.repeats} runs, {args.threads} thread(s))"
    )
    print("\n".join(speed_table(rows)))
    print(
        "ideal = FLOPs only (matmuls, attention): a measured speedup above it comes from work the\n"
        "ideal does not count (embedding lookups, element-wise ops and memory traffic on request\n"
        "features, repeated per candidate by the original model); below it, from per-call costs\n"
        "(framework overhead, kernel launches) and gathers that sharing does not remove."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
