"""Fixed per-call cost of a compiled model: what a call costs on top of its graph's ops.

For each zoo model at one shape (default R = 1 request, N = 16 candidates), times in one process,
round-robin, with one torch thread and the thread's CPU time as the clock (medians):

- ``eager``: ``model(**batch.replicated())``;
- ``program``: the compiled graph's straight-line program alone, on prepared inputs;
- ``shared``: ``cm(**batch.kwargs, candidate_to_request=idx)``;
- ``drop-in``: ``cm(**batch.replicated())``;
- ``guards``: the per-call check that the model is still the one compiled
  (``runtime/follow/guards.py``), alone, with the number of C-level reads it makes (one per table, class and ``forward``).

``shared - program`` is the runtime's fixed cost in the shared layout (input and index checks,
weight version check, guards, output tree); ``drop-in - program`` adds finding the requests.
``--profile`` also prints a cProfile of 1000 calls of each layout. ``--calls`` prints instead the
function calls one call makes (``sys.setprofile``'s count, with ``--formats`` per format): a
measure of the fixed cost that this machine's noise does not move.

``--formats`` measures instead the floor of a bucket settled on the plain program, one row per
input format (tensors, dict, batch object, column ranges, KJT; ``settled_formats.py``): the
drop-in and shared-layout calls against the original model, and their difference, at R requests
of N candidates each; for a format whose original model takes the shared-layout call itself (KJT),
also the shared call against the original model on that call, checked, inside
``rocs.trusted_index()`` entered for each call (the model reads the KJT's inverse indices
unchecked), and both calls again inside one ``rocs.trusted_index()`` around all their rounds (a
serving loop that builds its own index enters it once). Differences are
medians over rounds of one round's difference, each round starting from the next call in turn, so
that a drift of the machine's speed over the run moves both sides alike. Each case is called
``WARM_UP`` times first, past its buckets' trials of the plain program against the original model
(``runtime/call/original_arm.py``); the last column says which one its buckets kept.

Usage::

    python benchmarks/call_overhead.py
    python benchmarks/call_overhead.py --models dlrm mmoe --profile
    python benchmarks/call_overhead.py --formats --requests 4 --candidates 512
    python benchmarks/call_overhead.py --calls [--formats --requests 4 --candidates 128]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

import rocs_compiler as rocs
from models_zoo import ZOO
from settled_formats import format_cases


WARM_UP = 40  # calls of each layout before a settled format case is timed


def round_robin_samples(calls: dict, rounds: int, loops: int) -> dict[str, list[float]]:
    """Microseconds per call of each of ``calls``, one sample a round; each round starts from
    the next call in turn, so that no call always runs after the same one."""
    samples = {name: [] for name in calls}
    names = list(calls)
    for round_ in range(rounds):
        start_at = round_ % len(names)
        for name in names[start_at:] + names[:start_at]:
            call = calls[name]
            start = time.thread_time()
            for _ in range(loops):
                call()
            samples[name].append((time.thread_time() - start) / loops * 1e6)
    return samples


def time_round_robin(calls: dict, rounds: int, loops: int) -> dict[str, float]:
    """Median microseconds per call of each of ``calls``."""
    samples = round_robin_samples(calls, rounds, loops)
    return {name: statistics.median(v) for name, v in samples.items()}


def paired(samples: dict[str, list[float]], name: str, baseline: str) -> float:
    """The median over rounds of ``name``'s sample minus ``baseline``'s of the same round: a
    drift of the machine's speed over the run moves both alike."""
    return statistics.median(a - b for a, b in zip(samples[name], samples[baseline]))


def profile(call, calls: int = 1000, top: int = 20) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(ZOO))
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--candidates", type=int, default=16, help="per request")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--loops", type=int, default=50)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--formats", action="store_true", help="settled plain buckets per format")
    parser.add_argument("--calls", action="store_true", help="Python calls per call, not time")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.calls:
        return calls_table(args)
    if args.formats:
        return formats_table(args)
    print("| model | eager us | program us | shared us | drop-in us | shared - program | "
          "drop-in - program | eager / shared | eager / drop-in | guards us (checks) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with torch.no_grad():
        for name in args.models:
            model, cm, replicated, kwargs, index = zoo_case(name, args)
            cm(**kwargs, candidate_to_request=index)
            leaves = cm.contract.leaves((), kwargs)
            program = cm._graph_runner()
            inputs = [leaves[n] for n in cm.contract.input_names]
            calls = {
                "eager": lambda: model(**replicated),
                "program": lambda: program(*inputs, index),
                "shared": lambda: cm(**kwargs, candidate_to_request=index),
                "dropin": lambda: cm(**replicated),
                "guards": cm._guards.check,
            }
            t = time_round_robin(calls, args.rounds, args.loops)
            print(
                f"| {name} | {t['eager']:.0f} | {t['program']:.0f} | {t['shared']:.0f} | "
                f"{t['dropin']:.0f} | {t['shared'] - t['program']:.0f} | "
                f"{t['dropin'] - t['program']:.0f} | {t['eager'] / t['shared']:.2f} | "
                f"{t['eager'] / t['dropin']:.2f} | {t['guards']:.1f} "
                f"({len(cm._guards._fast.getters)}) |",
                flush=True,
            )
            if args.profile:
                for layout in ("shared", "dropin"):
                    print(f"\ncProfile, {name}, {layout}:\n{profile(calls[layout])}")


def python_calls(call, calls: int = 20) -> float:
    """Function calls (Python and C, as ``sys.setprofile`` sees them) per call of ``call``: a
    count that does not depend on the machine's noise, unlike a time."""
    seen = [0]

    def count(frame, event, arg):
        if event in ("call", "c_call"):
            seen[0] += 1

    sys.setprofile(count)
    try:
        for _ in range(calls):
            call()
    finally:
        sys.setprofile(None)
    return seen[0] / calls


def zoo_case(name: str, args):
    """``(model, compiled, replicated kwargs, shared kwargs, index)`` of zoo model ``name`` at
    ``args.requests`` requests of ``args.candidates`` candidates."""
    entry = ZOO[name]
    model = entry.build(seed=0)
    example = entry.make_batch([4, 3]).replicated()
    cm = rocs.compile(model, list(entry.request_inputs), example_kwargs=example)
    batch = entry.make_batch([args.candidates] * args.requests)
    return model, cm, batch.replicated(), batch.kwargs, batch.candidate_to_request


def calls_table(args) -> None:
    """Python calls per call: the zoo models' shared and drop-in calls or (``--formats``) each
    format's settled plain buckets, past their trials."""
    with torch.no_grad():
        (format_calls_table if args.formats else model_calls_table)(args)


def lanes_taken(cm) -> str:
    """The lane each bucket of ``cm`` settled on (``cm.program_choices()``, and for a bucket
    settled on the plain program ``cm.plain_runs()``): calls counted on different lanes are not
    comparable, and which lane a bucket keeps is measured, so it can differ from run to run."""
    runs = cm.plain_runs()
    lanes = {
        key[0]: runs.get(key, runs.get(key[:2] + (0,), program))
        for key, program in cm.program_choices().items()
    }
    return ", ".join(f"{layout}: {lane}" for layout, lane in sorted(lanes.items()))


def model_calls_table(args) -> None:
    print("| model | shared calls | drop-in calls | lanes |")
    print("|---|---:|---:|---|")
    for name in args.models:
        _, cm, replicated, kwargs, index = zoo_case(name, args)

        def shared():
            return cm(**kwargs, candidate_to_request=index)

        def dropin():
            return cm(**replicated)

        for _ in range(WARM_UP):
            shared(), dropin()
        print(f"| {name} | {python_calls(shared):.0f} | {python_calls(dropin):.0f} | "
              f"{lanes_taken(cm)} |")


def format_calls_table(args) -> None:
    print("| format | drop-in calls | shared calls | trusted shared calls | lanes |")
    print("|---|---:|---:|---:|---|")
    for case in format_cases(args.requests, args.candidates):
        for _ in range(WARM_UP):
            case.dropin(), case.shared()
        trusted = f"{python_calls(case.trusted_shared):.0f}" if case.trusted_shared else "-"
        print(f"| {case.name} | {python_calls(case.dropin):.0f} | "
              f"{python_calls(case.shared):.0f} | {trusted} | {lanes_taken(case.compiled)} |",
              flush=True)  # fmt: skip


def formats_table(args) -> None:
    """One row per input format: a bucket settled on the plain program against eager."""
    print("| format | eager us | drop-in us | shared us | drop-in - eager | shared - eager | "
          "original on the shared call us | shared - that | trusted shared - that | "
          "in one trusted context - that | runs (drop-in, shared) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    with torch.no_grad():
        for case in format_cases(args.requests, args.candidates):
            calls = {"eager": case.eager, "dropin": case.dropin, "shared": case.shared}
            for _ in range(WARM_UP):  # past the settled buckets' plain-or-original trials
                case.dropin(), case.shared()
            kept = {key[0]: arm for key, arm in case.compiled.plain_runs().items()}
            runs = ", ".join(kept.get(layout, "original") for layout in ("dropin", "shared"))
            if case.original_shared is not None:
                calls["original_shared"] = case.original_shared
            if case.trusted_shared is not None:
                calls["trusted_shared"] = case.trusted_shared
            samples = round_robin_samples(calls, args.rounds, args.loops)
            t = {name: statistics.median(v) for name, v in samples.items()}
            as_called = (
                f"{t['original_shared']:.1f} | {paired(samples, 'shared', 'original_shared'):+.1f}"
                if "original_shared" in t else "- | -"
            )
            if "trusted_shared" in t:
                with rocs.trusted_index():  # entered once, as a serving loop that builds its index
                    inside = round_robin_samples(
                        {"original_shared": case.original_shared, "shared": case.shared},
                        args.rounds, args.loops,
                    )
                as_called += (
                    f" | {paired(samples, 'trusted_shared', 'original_shared'):+.1f}"
                    f" | {paired(inside, 'shared', 'original_shared'):+.1f}"
                )
            else:
                as_called += " | - | -"
            print(
                f"| {case.name} | {t['eager']:.1f} | {t['dropin']:.1f} | {t['shared']:.1f} | "
                f"{paired(samples, 'dropin', 'eager'):+.1f} | "
                f"{paired(samples, 'shared', 'eager'):+.1f} | {as_called} | {runs} |",
                flush=True,
            )
            if args.profile:
                for layout in ("dropin", "shared"):
                    print(f"\ncProfile, {case.name}, {layout}:\n{profile(calls[layout])}")


if __name__ == "__main__":
    main()
