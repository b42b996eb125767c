"""Speed benchmark: eager vs Inductor vs ROCS on every zoo model.

For each zoo model, each number of requests R and each number of candidates per request N,
the script times

- ``eager``: ``model(**batch.replicated())`` under ``torch.no_grad()``;
- ``inductor``: ``torch.compile(model, dynamic=True)`` on the same replicated inputs (compiled
  once per model, reused across shapes, warmed up once per shape);
- ``rocs shared``: ``cm(**batch.kwargs, candidate_to_request=idx)`` where
  ``cm = rocs.compile(model, entry.request_inputs, example_kwargs=entry.make_batch([4, 3]).replicated())``
  (request inputs with R rows, candidate inputs with R * N rows);
- ``rocs drop-in``: ``cm(**batch.replicated())``, the original call; includes finding the
  requests in the replicated rows.

Inputs are built before timing (the replicated kwargs of a shape are computed once), so every
variant times the model call only. Within one shape the variants run round-robin, starting from
a different variant each round, so drift on a shared machine affects all of them alike; the
number of rounds is at least ``--min-repeats`` and stops at ``--max-repeats`` or once the
slowest variant has spent ``--budget`` seconds. The reported time is the median.

Each row also gives the ideal speedup from the compiler's FLOP report,
``cm.report(candidates=N, requests=R).ideal_speedup()``, and the efficiency
(measured shared-layout speedup over eager divided by the ideal).

Peak memory (one shape, R = 1, ``--memory-candidates`` per request): on CUDA,
``torch.cuda.max_memory_allocated`` minus the allocation before the call. On CPU, the call runs
once under ``torch.profiler`` with ``profile_memory=True``; the profiler records every
allocation and free of the CPU allocator as a ``[memory]`` event with a signed byte count; the
events are sorted by time and the peak of their running sum is the peak of bytes allocated during
the call on top of what was live before it (weights and inputs are not counted, the output is).

Every variant's output is also compared with eager once per shape; a mismatch is reported on
stderr and in the JSON (``max_abs_err``), never silently.

Usage::

    python benchmarks/speed.py                      # all models, all shapes, Markdown on stdout
    python benchmarks/speed.py --models dlrm din --no-inductor --json out.json
    python benchmarks/speed.py --quick --models dlrm  # tiny sizes, 2 repeats (for tests)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

import rocs_compiler as rocs
from allocator import retain_freed_memory
from models_zoo import ZOO

VARIANTS = ("eager", "inductor", "rocs_shared", "rocs_dropin")
LABELS = {
    "eager": "eager",
    "inductor": "inductor",
    "rocs_shared": "rocs shared",
    "rocs_dropin": "rocs drop-in",
}
# Outputs must agree with eager up to re-association of float32 sums.
RTOL, ATOL = 1e-4, 1e-4


# -- progress -------------------------------------------------------------------------------------


class Progress:
    """A progress bar on stderr (tqdm when installed, else one line per step)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, file=sys.stderr, unit="shape", dynamic_ncols=True)
            except ImportError:
                pass

    def note(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_description(label)
            self._bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# -- measurement ----------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    fns: dict[str, Callable[[], Any]],
    device: torch.device,
    min_repeats: int,
    max_repeats: int,
    budget_s: float,
) -> tuple[dict[str, list[float]], int]:
    """Seconds per call of every function, sampled round-robin; returns the samples and rounds.

    Round ``k`` starts with function ``k mod len(fns)`` so no variant always runs right after
    the same neighbour. Stops after ``max_repeats`` rounds, or after ``min_repeats`` once the
    slowest function has accumulated ``budget_s`` seconds.
    """
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    rounds = 0
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with torch.no_grad():
            while True:
                shift = rounds % len(names)
                for name in names[shift:] + names[:shift]:
                    _sync(device)
                    start = time.perf_counter()
                    fns[name]()
                    _sync(device)
                    samples[name].append(time.perf_counter() - start)
                rounds += 1
                if rounds >= max_repeats:
                    break
                if rounds >= min_repeats and max(sum(s) for s in samples.values()) >= budget_s:
                    break
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples, rounds


@contextlib.contextmanager
def _native_stderr_silenced():
    """Nothing written to file descriptor 2 (Kineto prints ``USDT: ... profiler_start`` and
    ``profiler_stop`` lines there from C++ at every profile, whatever KINETO_LOG_LEVEL says,
    interleaving them with the progress lines)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_memory_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes allocated during one call of ``fn``, above what was allocated before it."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.no_grad():
            out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del out
        return int(peak)
    from torch.profiler import ProfilerActivity, profile

    with _native_stderr_silenced(), torch.no_grad():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
    del out
    # Raw allocator events: "[memory]" with a signed byte count (+ alloc, - free), in time order.
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    if not events:
        raise RuntimeError("the profiler recorded no CPU allocator events")
    events.sort(key=lambda ev: ev[0])
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return int(peak)


# -- inputs and outputs ---------------------------------------------------------------------------


def _to_device(tree, device: torch.device):
    return pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, tree)


def _max_abs_err(reference, output) -> float | None:
    """Largest absolute difference over all output tensors; None if the structures differ."""
    ref_leaves, ref_spec = pytree.tree_flatten(reference)
    out_leaves, out_spec = pytree.tree_flatten(output)
    if ref_spec != out_spec:
        return None
    worst = 0.0
    for a, b in zip(ref_leaves, out_leaves):
        if isinstance(a, torch.Tensor) and a.numel():
            if a.shape != b.shape:
                return None
            worst = max(worst, float((a.float() - b.float()).abs().max()))
    return worst


def _allclose(reference, output) -> bool:
    ref_leaves, ref_spec = pytree.tree_flatten(reference)
    out_leaves, out_spec = pytree.tree_flatten(output)
    if ref_spec != out_spec:
        return False
    return all(
        not isinstance(a, torch.Tensor)
        or (a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=RTOL, atol=ATOL))
        for a, b in zip(ref_leaves, out_leaves)
    )


def _reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(err).__name__}: {first}"[:300]


# -- one model ------------------------------------------------------------------------------------


@dataclass
class ModelState:
    name: str
    model: torch.nn.Module
    cm: Any | None = None
    rocs_error: str | None = None
    compiled: Callable | None = None  # torch.compile(model, dynamic=True)
    inductor_error: str | None = None
    inductor_compile_s: float | None = None
    rocs_compile_s: float | None = None


def prepare_model(name: str, args, device: torch.device, progress: Progress) -> ModelState:
    entry = ZOO[name]
    model = entry.build(seed=args.seed).to(device).eval()
    state = ModelState(name, model)
    example = _to_device(entry.make_batch([4, 3], seed=args.seed).replicated(), device)
    progress.note(f"{name}: rocs.compile ...")
    start = time.perf_counter()
    try:
        state.cm = rocs.compile(
            model, entry.request_inputs, example_kwargs=example, options=args.rocs_options
        )
        state.rocs_compile_s = time.perf_counter() - start
        progress.note(f"{name}: rocs.compile done in {state.rocs_compile_s:.1f} s")
    except Exception as err:  # noqa: BLE001 - reported as n/a with the reason
        state.rocs_error = _reason(err)
        progress.note(f"{name}: rocs n/a ({state.rocs_error})")
    if args.inductor:
        state.compiled = torch.compile(model, dynamic=True)
    else:
        state.inductor_error = "skipped (--no-inductor)"
    return state


def _variant_calls(state: ModelState, batch, replicated: dict) -> dict[str, Callable[[], Any]]:
    calls: dict[str, Callable[[], Any]] = {"eager": lambda: state.model(**replicated)}
    if state.compiled is not None:
        calls["inductor"] = lambda: state.compiled(**replicated)
    if state.cm is not None:
        kwargs, index = batch.kwargs, batch.candidate_to_request
        calls["rocs_shared"] = lambda: state.cm(**kwargs, candidate_to_request=index)
        calls["rocs_dropin"] = lambda: state.cm(**replicated)
    return calls


def _warm_up(state: ModelState, calls: dict, reference, row: dict, progress: Progress) -> None:
    """Run every variant once (compiling Inductor on its first shape) and check its output."""
    for variant in list(calls):
        if variant == "eager":
            continue
        first_inductor_call = variant == "inductor" and state.inductor_compile_s is None
        if first_inductor_call:
            progress.note(f"{state.name}: inductor compile (first call, slow on few cores) ...")
        start = time.perf_counter()
        try:
            with torch.no_grad():
                out = calls[variant]()
        except Exception as err:  # noqa: BLE001 - reported as n/a with the reason
            reason = _reason(err)
            row["errors"][variant] = reason
            del calls[variant]
            if variant == "inductor" and first_inductor_call:
                state.compiled, state.inductor_error = None, reason
            progress.note(f"{state.name}: {LABELS[variant]} n/a ({reason})")
            continue
        if first_inductor_call:
            state.inductor_compile_s = time.perf_counter() - start
            progress.note(f"{state.name}: inductor compiled in {state.inductor_compile_s:.1f} s")
        err = _max_abs_err(reference, out)
        row["max_abs_err"][variant] = err
        if not _allclose(reference, out):
            progress.note(
                f"WARNING {state.name} R={row['R']} N={row['N_per_request']}: {LABELS[variant]} "
                f"differs from eager (max abs err {err})"
            )
            row["mismatch"].append(variant)


def measure_shape(state: ModelState, R: int, N: int, args, device, progress) -> dict:
    entry = ZOO[state.name]
    batch = entry.make_batch([N] * R, seed=args.seed)
    batch.kwargs = _to_device(batch.kwargs, device)
    batch.candidate_to_request = batch.candidate_to_request.to(device)
    replicated = batch.replicated()
    row: dict[str, Any] = {
        "model": state.name,
        "R": R,
        "N_per_request": N,
        "N_total": R * N,
        "errors": {},
        "max_abs_err": {},
        "mismatch": [],
    }
    if state.rocs_error:
        row["errors"]["rocs_shared"] = row["errors"]["rocs_dropin"] = state.rocs_error
    if state.compiled is None and state.inductor_error:
        row["errors"]["inductor"] = state.inductor_error
    with torch.no_grad():
        reference = state.model(**replicated)
    calls = _variant_calls(state, batch, replicated)
    _warm_up(state, calls, reference, row, progress)
    del reference
    samples, rounds = time_interleaved(
        calls, device, args.min_repeats, args.max_repeats, args.budget
    )
    row["repeats"] = rounds
    for variant in VARIANTS:
        if variant in samples:
            values = sorted(samples[variant])
            row[f"{variant}_ms"] = statistics.median(values) * 1e3
            row[f"{variant}_min_ms"] = values[0] * 1e3
        else:
            row[f"{variant}_ms"] = None
    eager = row["eager_ms"]
    for variant, key in (("rocs_shared", "speedup_shared"), ("rocs_dropin", "speedup_dropin")):
        row[key] = eager / row[f"{variant}_ms"] if row[f"{variant}_ms"] else None
    row["speedup_inductor"] = eager / row["inductor_ms"] if row["inductor_ms"] else None
    if state.cm is not None:
        report = state.cm.report(candidates=N, requests=R)
        row["ideal_speedup"] = report.ideal_speedup()
        row["efficiency"] = (
            row["speedup_shared"] / row["ideal_speedup"] if row["speedup_shared"] else None
        )
    else:
        row["ideal_speedup"] = row["efficiency"] = None

    if R == 1 and N == args.memory_candidates:
        row["memory_bytes"] = measure_memory(calls, device, progress, state.name)
    return row


def measure_memory(calls: dict, device, progress: Progress, name: str) -> dict:
    memory: dict[str, int | None] = {}
    for variant in VARIANTS:
        if variant not in calls:
            memory[variant] = None
            continue
        try:
            memory[variant] = peak_memory_bytes(calls[variant], device)
        except Exception as err:  # noqa: BLE001 - reported as n/a
            memory[variant] = None
            progress.note(f"{name}: peak memory of {LABELS[variant]} n/a ({_reason(err)})")
    return memory


# -- output ---------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.2f}"


def speed_table(rows: list[dict]) -> str:
    header = [
        "model",
        "R",
        "N/req",
        "eager ms",
        "inductor ms",
        "rocs shared ms",
        "rocs drop-in ms",
        "shared vs eager",
        "drop-in vs eager",
        "ideal",
        "efficiency",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * 8) + "|"]
    for row in rows:
        eff = row.get("efficiency")
        cells = [
            row["model"],
            str(row["R"]),
            str(row["N_per_request"]),
            _ms(row["eager_ms"]),
            _ms(row["inductor_ms"]),
            _ms(row["rocs_shared_ms"]),
            _ms(row["rocs_dropin_ms"]),
            _x(row["speedup_shared"]),
            _x(row["speedup_dropin"]),
            _x(row["ideal_speedup"]),
            "n/a" if eff is None else f"{eff:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_table(rows: list[dict]) -> str:
    header = [
        "model",
        "R",
        "N/req",
        "eager MiB",
        "inductor MiB",
        "rocs shared MiB",
        "rocs drop-in MiB",
        "shared / eager",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * 5) + "|"]
    for row in rows:
        mem = row.get("memory_bytes")
        if not mem:
            continue
        ratio = (
            f"{mem['rocs_shared'] / mem['eager']:.2f}"
            if mem.get("eager") and mem.get("rocs_shared") is not None
            else "n/a"
        )
        cells = [row["model"], str(row["R"]), str(row["N_per_request"])]
        cells += [_mib(mem.get(v)) for v in VARIANTS] + [ratio]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def notes_lines(results: dict) -> list[str]:
    lines = []
    for name, info in results["models"].items():
        for key, label in (("rocs_error", "rocs"), ("inductor_error", "inductor")):
            if info.get(key) and not info[key].startswith("skipped"):
                lines.append(f"- {name}: {label} n/a: {info[key]}")
    for row in results["rows"]:
        for variant, reason in row["errors"].items():
            model_level = results["models"][row["model"]]
            if reason in (model_level.get("rocs_error"), model_level.get("inductor_error")):
                continue
            lines.append(
                f"- {row['model']} R={row['R']} N={row['N_per_request']}: "
                f"{LABELS[variant]} n/a: {reason}"
            )
        if row["mismatch"]:
            lines.append(
                f"- {row['model']} R={row['R']} N={row['N_per_request']}: output of "
                f"{', '.join(LABELS[v] for v in row['mismatch'])} differs from eager"
            )
    return lines


def render_markdown(results: dict, with_meta: bool) -> str:
    meta = results["meta"]
    parts = []
    if with_meta:
        parts.append(
            "\n".join(
                [
                    f"- command: `{meta['command']}`",
                    (
                        f"- device: {meta['device']} ({meta['device_name']}), "
                        f"torch threads: {meta['threads']}"
                    ),
                    f"- torch {meta['torch']}, Python {meta['python']}",
                    f"- malloc: {meta.get('malloc', 'as the process found it')}",
                    f"- date: {meta['date']}",
                    (
                        f"- repeats: median of {meta['min_repeats']}..{meta['max_repeats']} "
                        f"interleaved rounds, budget {meta['budget_s']} s per shape"
                    ),
                ]
            )
        )
    parts.append(speed_table(results["rows"]))
    mem = memory_table(results["rows"])
    if mem:
        parts.append("Peak memory during one call (" + meta["memory_method"] + "):\n\n" + mem)
    notes = notes_lines(results)
    if notes:
        parts.append("Notes:\n\n" + "\n".join(notes))
    return "\n\n".join(parts) + "\n"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {_cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {_cpu_count()} cores"


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            check=False,
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            timeout=10,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# -- main -----------------------------------------------------------------------------------------


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The benchmark's options; ``rocs bench`` parses with it too (``prog="rocs bench"``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Time eager, Inductor and ROCS (shared and drop-in) on the zoo models.",
    )
    parser.add_argument(
        "model_names",
        nargs="*",
        metavar="MODEL",
        help="zoo models, the same as --models (default: all)",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(ZOO),
        default=None,
        metavar="MODEL",
        help=f"zoo models (default: all): {', '.join(ZOO)}",
    )
    parser.add_argument(
        "--candidates",
        nargs="+",
        type=int,
        default=None,
        metavar="N",
        help="candidates per request (default: 16 128 1024; --quick: 4)",
    )
    parser.add_argument(
        "--requests",
        nargs="+",
        type=int,
        default=None,
        metavar="R",
        help="requests per batch (default: 1 8; --quick: 1 2)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (default: all cores available to the process)",
    )
    parser.add_argument(
        "--no-inductor", dest="inductor", action="store_false", help="skip torch.compile (Inductor)"
    )
    parser.add_argument("--min-repeats", type=int, default=None, help="default 5 (--quick: 2)")
    parser.add_argument("--max-repeats", type=int, default=None, help="default 50 (--quick: 2)")
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds the slowest variant may spend per shape before stopping "
        "(after --min-repeats); default 0.5 (--quick: 0)",
    )
    parser.add_argument(
        "--memory-candidates",
        type=int,
        default=None,
        help="candidates per request for the peak-memory shape (R = 1); "
        "default 1024, or the largest --candidates with --quick; "
        "measured only if it is among --candidates and 1 among --requests",
    )
    parser.add_argument(
        "--rocs-options",
        type=json.loads,
        default=None,
        help="JSON dict of rocs.compile pass options, e.g. '{\"ikbo\": false}'",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 2 repeats (tests)")
    parser.add_argument("--json", type=Path, default=None, help="write all results as JSON")
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="write the tables with the run's metadata as Markdown",
    )
    parser.add_argument(
        "--malloc",
        choices=("retain", "system"),
        default="retain",
        help="keep freed CPU memory in the process (default; see allocator.py) or leave "
        "glibc's malloc as it is",
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    return parser


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    parser = build_parser(prog)
    args = parser.parse_args(argv)

    unknown = [m for m in args.model_names if m not in ZOO]
    if unknown:
        parser.error(
            f"argument MODEL: invalid choice: {unknown[0]!r} (choose from {', '.join(ZOO)})"
        )
    args.models = list(dict.fromkeys([*args.model_names, *(args.models or [])])) or list(ZOO)
    args.candidates = args.candidates or ([4] if args.quick else [16, 128, 1024])
    args.requests = args.requests or ([1, 2] if args.quick else [1, 8])
    if args.min_repeats is None:
        args.min_repeats = 2 if args.quick else 5
    if args.max_repeats is None:
        args.max_repeats = 2 if args.quick else 50
    args.max_repeats = max(args.max_repeats, args.min_repeats, 1)
    if args.budget is None:
        args.budget = 0.0 if args.quick else 0.5
    if args.memory_candidates is None:
        args.memory_candidates = max(args.candidates) if args.quick else 1024
    if any(n < 1 for n in args.candidates) or any(r < 1 for r in args.requests):
        parser.error("--candidates and --requests must be positive")
    if args.rocs_options is not None and not isinstance(args.rocs_options, dict):
        parser.error("--rocs-options must be a JSON object")
    try:
        rocs.Options.from_mapping(args.rocs_options, where="--rocs-options")
    except rocs.OptionsError as err:
        parser.error(str(err))
    return args


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    threads = args.threads or _cpu_count()
    torch.set_num_threads(threads)
    retained = args.malloc == "retain" and retain_freed_memory()
    shapes = [(R, N) for R in args.requests for N in args.candidates]
    progress = Progress(len(args.models) * len(shapes), enabled=args.progress)
    results: dict[str, Any] = {
        "meta": {
            "command": shlex.join(["python", "benchmarks/speed.py", *argv]),
            "device": args.device,
            "device_name": _device_name(device),
            "threads": threads,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "git_commit": _git_commit(),
            "min_repeats": args.min_repeats,
            "max_repeats": args.max_repeats,
            "budget_s": args.budget,
            "rocs_options": args.rocs_options,
            "malloc": "glibc, freed memory retained" if retained else "as the process found it",
            "memory_method": (
                "torch.cuda.max_memory_allocated above the allocation before the call"
                if device.type == "cuda"
                else "peak running sum of CPU allocator events recorded by torch.profiler "
                "with profile_memory=True; allocations made during the call, inputs and "
                "weights excluded, output included"
            ),
        },
        "models": {},
        "rows": [],
    }
    started = time.perf_counter()
    try:
        for name in args.models:
            state = prepare_model(name, args, device, progress)
            for R, N in shapes:
                row = measure_shape(state, R, N, args, device, progress)
                results["rows"].append(row)
                progress.step(f"{name} R={R} N={N}")
            results["models"][name] = {
                "rocs_error": state.rocs_error,
                "inductor_error": state.inductor_error,
                "rocs_compile_s": state.rocs_compile_s,
                "inductor_compile_s": state.inductor_compile_s,
            }
            del state
            gc.collect()
            if args.inductor:
                torch._dynamo.reset()
    finally:
        progress.close()
    results["meta"]["wall_s"] = time.perf_counter() - started
    return results


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    results = run(args, argv)
    print(render_markdown(results, with_meta=False), end="")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(render_markdown(results, with_meta=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
