"""What bounds a model's efficiency: where eager and the shared program spend their CPU time.

``speed.py``'s efficiency is (eager time / rocs shared time) / ideal, the ideal being the FLOP
ratio of the compiler's cost model (``cm.report(...).ideal_speedup()``: GEMM and attention FLOPs
only). This script profiles both calls and splits their time by kind of work.

Method, per model (one torch thread by default, ``torch.no_grad()``):

- ``rocs.compile(..., options={"autotune": False})``: with autotune on, the compiled model may
  settle on its plain (unshared) program for a call size, and we would not profile the shared one.
- Eager (``batch.replicated()``) and rocs (``batch.kwargs``, ``candidate_to_request``): warm-up,
  outputs compared (allclose 1e-4).
- Timing without the profiler: ``--calls`` rounds, eager and rocs alternating, wall time (the
  profiler's clock), medians: the measured speedup and efficiency.
- One ``torch.profiler`` session (CPU) of ``--calls`` rounds, again alternating, each call in a
  named range. Every ATen op's *self* time (its time minus its children's) goes to a category by
  the op's name; self times are disjoint, so their sum is the time inside ATen. ``index_select``
  and friends under an ``embedding`` op are lookups, elsewhere (request rows gathered to the
  candidates) gathers. "outside ATen" is the profiled call time minus the time inside ATen:
  Python, module calls, the rocs runtime and program, and the profiler's own cost (some of it
  lands inside the ops, so unprofiled time minus ATen can go negative). ``rocs::`` ranges are
  not ops: region ranges are left out, fused ops are listed apart with their inclusive time.
- "over ideal": rocs's time minus eager's time / FLOP ideal, per category; they add up to the
  whole gap to the ideal of the profiled calls (rocs time - eager time / ideal).
- GEMM-only ideal: ``1 / (1 - g + g / ideal)``, the speedup if only eager's GEMM time (a share
  ``g``) shrank by the FLOP ratio; a model beating it also shares non-GEMM (request) work.
- glibc gives freed buffers back to the OS, depending on its history (which the profiler changes),
  and the op that first writes one pays the page faults (about 0.3 ms per MiB here): freed memory
  is kept in the process (``allocator.py``) unless ``--default-malloc``; faults per call are printed.

Usage::

    python benchmarks/efficiency_profile.py                       # dlrm two_tower din, N=1024
    python benchmarks/efficiency_profile.py --models hstu --calls 10 --markdown out.md
    python benchmarks/efficiency_profile.py --quick --models two_tower   # smoke test
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils import _pytree as pytree

import rocs_compiler as rocs
from allocator import retain_freed_memory
from models_zoo import ZOO

GEMM, LOOKUP, GATHER = "GEMM & attention", "embedding lookups", "gathers & indexing"
MOVE, ELEMENTWISE = "data movement", "elementwise & reductions"
VIEWS, OUTSIDE = "views, allocation, scalar reads", "outside ATen"
CATEGORIES = (GEMM, LOOKUP, GATHER, MOVE, ELEMENTWISE, VIEWS, OUTSIDE)
_OPS = {
    GEMM: "mm addmm addmm_ bmm baddbmm baddbmm_ addbmm matmul linear mv addmv dot einsum _mkl_linear"
    " mkldnn_linear"
    " _scaled_dot_product_flash_attention_for_cpu scaled_dot_product_attention"
    " _scaled_dot_product_attention_math convolution _convolution conv1d conv2d mkldnn_rnn_layer",
    LOOKUP: "embedding embedding_bag _embedding_bag _embedding_bag_forward_only",
    GATHER: "index_select gather index take take_along_dim masked_select index_add"
    " scatter scatter_add index_put_ _index_put_impl_",
    MOVE: "cat stack copy_ clone contiguous _to_copy to repeat repeat_interleave tile"
    " slice_scatter select_scatter index_copy narrow_copy constant_pad_nd pad flip roll",
    VIEWS: "view _unsafe_view reshape _reshape_alias t transpose permute expand expand_as unsqueeze"
    " squeeze select slice narrow as_strided alias detach unbind split split_with_sizes chunk"
    " flatten unflatten view_as movedim diagonal resolve_conj resolve_neg empty empty_like"
    " empty_strided new_empty new_empty_strided resize_ item _local_scalar_dense lift_fresh",
}
CATEGORY = {op: cat for cat, ops in _OPS.items() for op in ops.split()}
REGIONS = ("rocs::request_region", "rocs::candidate_region")
RTOL = ATOL = 1e-4


def profile_calls(calls: dict, rounds: int) -> dict:
    """Per variant, per call: ATen self time by category and by (op, category), with counts, and
    inclusive / inside-ATen time of each fused ``rocs::`` op."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for call in calls.values():  # the first calls under a profiler are slow: not counted
            call()
        for _ in range(rounds):
            for name, call in calls.items():
                with record_function(f"efficiency_profile::{name}"):
                    call()
    out = {name: {"profiled": 0.0, "cats": defaultdict(float), "ops": defaultdict(lambda: [0, 0]),
                  "fused": defaultdict(lambda: [0, 0])} for name in calls}
    for ev in prof.events():
        chain, parent = [], ev.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        if ev.name.startswith("efficiency_profile::"):
            out[ev.name.split("::")[1]]["profiled"] += ev.cpu_time_total / rounds
            continue
        if not chain or not chain[-1].startswith("efficiency_profile::"):
            continue  # outside the counted calls
        acc = out[chain[-1].split("::")[1]]
        if ev.name.startswith("aten::"):
            op = ev.name.removeprefix("aten::")
            cat = CATEGORY.get(op, ELEMENTWISE)
            callers = {CATEGORY.get(name.removeprefix("aten::")) for name in chain}
            if cat == GATHER and LOOKUP in callers:
                cat = LOOKUP
            acc["cats"][cat] += ev.self_cpu_time_total / rounds
            acc["ops"][op, cat][0] += ev.self_cpu_time_total / rounds
            acc["ops"][op, cat][1] += 1 / rounds
        elif ev.name.startswith("rocs::") and ev.name not in REGIONS:
            acc["fused"][ev.name][0] += ev.cpu_time_total / rounds
            acc["fused"][ev.name][1] += (ev.cpu_time_total - ev.self_cpu_time_total) / rounds
    return out


def time_calls(calls: dict, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall microseconds per call (the profiler's clock) and minor page faults per call."""
    samples, faults = {name: [] for name in calls}, dict.fromkeys(calls, 0.0)
    for _ in range(rounds):
        for name, call in calls.items():
            before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            call()
            samples[name].append((time.perf_counter() - start) * 1e6)
            faults[name] += (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / rounds
    return {name: statistics.median(v) for name, v in samples.items()}, faults


def check_outputs(name: str, reference, output) -> None:
    (ref, ref_spec), (out, out_spec) = pytree.tree_flatten(reference), pytree.tree_flatten(output)
    if ref_spec != out_spec or not all(torch.allclose(a, b, RTOL, ATOL) for a, b in zip(ref, out)):
        raise SystemExit(f"{name}: rocs shared output differs from eager")


def measure(name: str, args) -> dict:
    entry = ZOO[name]
    model, example = entry.build(seed=0).eval(), entry.make_batch([4, 3]).replicated()
    cm = rocs.compile(model, entry.request_inputs, example_kwargs=example,
                      options={"autotune": False})
    batch = entry.make_batch([args.candidates] * args.requests)
    replicated, kwargs, index = batch.replicated(), batch.kwargs, batch.candidate_to_request
    calls = {"eager": lambda: model(**replicated),
             "rocs": lambda: cm(**kwargs, candidate_to_request=index)}
    with torch.no_grad():
        for _ in range(3):
            reference, output = calls["eager"](), calls["rocs"]()
        check_outputs(name, reference, output)
        del reference, output
        times, faults = time_calls(calls, args.calls)
        prof = profile_calls(calls, args.calls)
    for variant, acc in prof.items():
        acc["cats"][OUTSIDE] = acc["profiled"] - sum(acc["cats"].values())
        acc["unprofiled"], acc["faults"] = times[variant], faults[variant]
    ideal = cm.report(candidates=args.candidates, requests=args.requests).ideal_speedup()
    share = prof["eager"]["cats"][GEMM] / prof["eager"]["profiled"]
    return {"name": name, "prof": prof, "ideal": ideal, "speedup": times["eager"] / times["rocs"],
            "profiled_speedup": prof["eager"]["profiled"] / prof["rocs"]["profiled"],
            "gemm_share": share, "gemm_ideal": 1 / (1 - share + share / ideal)}


def model_section(r: dict, args) -> str:
    e, c, ideal = r["prof"]["eager"], r["prof"]["rocs"], r["ideal"]
    lines = [f"### {r['name']} (N = {args.candidates}, R = {args.requests}, {args.calls} calls)",
             "", "| category | eager us/call | rocs us/call | saved us/call | over ideal us/call |",
             "|---|---:|---:|---:|---:|"]
    rows = [(cat, e["cats"][cat], c["cats"][cat]) for cat in CATEGORIES]
    rows += [("total (profiled)", e["profiled"], c["profiled"]),
             ("total (unprofiled, median)", e["unprofiled"], c["unprofiled"])]
    for cat, te, tc in rows:
        lines.append(f"| {cat} | {te:.0f} | {tc:.0f} | {te - tc:.0f} | {tc - te / ideal:.0f} |")
    fused = ", ".join(f"`{k}` {v[0]:.0f} ({v[1]:.0f} in ATen)" for k, v in c["fused"].items())
    lines += [
        f"\nPage faults per call {e['faults']:.0f} / {c['faults']:.0f}; rocs:: fused ops, "
        f"profiled inclusive us/call: {fused or 'none'}.\n",
        f"FLOP ideal {ideal:.2f}x; measured {r['speedup']:.2f}x (efficiency "
        f"{r['speedup'] / ideal:.2f}; profiled {r['profiled_speedup'] / ideal:.2f}); GEMMs are "
        f"{r['gemm_share']:.0%} of eager, so the GEMM-only ideal is {r['gemm_ideal']:.2f}x "
        f"(measured / GEMM-only ideal: {r['speedup'] / r['gemm_ideal']:.2f}).",
    ]
    ops = sorted(set(e["ops"]) | set(c["ops"]),
                 key=lambda k: c["ops"].get(k, (0, 0))[0] - e["ops"].get(k, (0, 0))[0])
    for title, chosen, sign in (("rocs - eager", ops[::-1][:8], 1), ("eager - rocs", ops[:8], -1)):
        lines += [f"\nTop ATen ops by self time, {title}:\n", "| op | category | eager us (calls) "
                  "| rocs us (calls) | difference us |", "|---|---|---:|---:|---:|"]
        for op, cat in chosen:
            (te, ne), (tc, nc) = e["ops"].get((op, cat), (0, 0)), c["ops"].get((op, cat), (0, 0))
            lines.append(f"| {op} | {cat} | {te:.0f} ({ne:.0f}) | {tc:.0f} ({nc:.0f}) | "
                         f"{sign * (tc - te):.0f} |")
    return "\n".join(lines) + "\n"


def summary(results: list[dict]) -> str:
    head = ["model", "eager us", "rocs us", "ideal", "measured", "efficiency (profiled)", "GEMM "
            "share", "GEMM-only ideal", *(f"{k}: eager / rocs (over ideal)" for k in CATEGORIES)]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in results:
        e, c, ideal = r["prof"]["eager"], r["prof"]["rocs"], r["ideal"]
        ec, cc = e["cats"], c["cats"]
        cells = [r["name"], f"{e['unprofiled']:.0f}", f"{c['unprofiled']:.0f}", f"{ideal:.2f}x",
                 f"{r['speedup']:.2f}x", f"{r['speedup'] / ideal:.2f} "
                 f"({r['profiled_speedup'] / ideal:.2f})", f"{r['gemm_share']:.0%}",
                 f"{r['gemm_ideal']:.2f}x",
                 *(f"{ec[k]:.0f} / {cc[k]:.0f} ({cc[k] - ec[k] / ideal:+.0f})" for k in CATEGORIES)]
        lines.append("| " + " | ".join(cells) + " |")
    return "### Summary (us per call; totals unprofiled)\n\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(ZOO), metavar="MODEL",
                        default=["dlrm", "two_tower", "din"], help=f"zoo models: {', '.join(ZOO)}")
    parser.add_argument("--candidates", type=int, help="per request (1024; --quick: 16)")
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--calls", type=int, help="calls per variant (20; --quick: 2)")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc settings alone (freed buffers go to the OS)")
    parser.add_argument("--quick", action="store_true", help="N = 16, 2 calls (smoke test)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the tables here")
    args = parser.parse_args(argv)
    args.candidates = args.candidates or (16 if args.quick else 1024)
    args.calls = args.calls or (2 if args.quick else 20)
    torch.set_num_threads(args.threads)
    kept = not args.default_malloc and retain_freed_memory()
    sections = [f"torch {torch.__version__}, {args.threads} thread(s), malloc: "
                f"{'freed memory kept (mallopt)' if kept else 'default'}\n"]
    print(sections[0], flush=True)
    results: list[dict] = []
    for name in args.models:
        results.append(measure(name, args))
        sections.append(model_section(results[-1], args))
        print(sections[-1], flush=True)
    sections.append(summary(results))
    print(sections[-1], end="")
    if args.markdown:
        args.markdown.write_text("\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
