"""The doors production compiles with, each against the expert's hand rewrite (issue #49).

    OMP_NUM_THREADS=1 python benchmarks/doors.py [--models dlrm,...] [--doors eager,aoti]
        [--sizes 1x270,4x1024] [--repeats 15] [--json FILE]

Four models (``hand_rewrites.CASES``: dlrm, DCNv2 with GLM masks, target_attention, a
transformer history ranker), each in three variants (``original`` on the replicated batch,
``hand`` and ``rocs`` on the shared layout), through four doors:

- ``eager``: ``model(**replicated)``; ``hand(**shared)``; ``cm(**shared)`` with
  ``cm = rocs.compile(model, request_inputs, example_kwargs=...)``;
- ``inductor``: ``torch.compile(model, dynamic=True)``; ``torch.compile(hand, dynamic=True)``;
  ``rocs.shared_call(torch.compile(model, backend="rocs", options=..., dynamic=True), **shared)``;
- ``aoti``: ``torch.export`` (the batch dynamic; R and N for the hand rewrite) compiled with
  ``aoti_compile_and_package``; ``rocs.aoti_package(rocs.export(cm, portable=True))``;
- ``onnx``: ``torch.onnx.export(dynamo=True)`` of the same exports;
  ``rocs.export_onnx(rocs.export(cm, portable=True))``; run by ONNX Runtime.

``hand`` is the rewrite a strong engineer writes for the shared layout (``hand_rewrites/``); it
is checked exact against the original before anything is timed. Sizes ``R x N``: N candidates
in total, request r holding about (r + 1) / (1 + ... + R) of them, in a shuffled order.

Method: one torch thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``), ONNX Runtime with
one intra-op and one inter-op thread, ``torch.no_grad()``, glibc's malloc keeping freed memory
(``allocator.py``). Within a door, model and size, the three variants run round-robin
(``regression.time_interleaved``: each round starts from another variant, each sample a loop of
calls of at least ``--sample-ms``), the clock the calling thread's CPU time; a cell is the median
of ``--repeats`` rounds. Before timing, every variant's output is compared with the original's
eager output (``allclose``, 1e-4; a mismatch marks the cell with ``!``) and warmed up (the rocs
variants for ``regression.WARMUP_CALLS`` calls, in which the compiled model settles on its
program; Inductor recompiles on the first call of a size it specialized, R = 1). A variant that
fails to build or to run shows its error kind in its cell; the rest goes on.

AOTInductor packages and ONNX files are cached under ``$TMPDIR/rocs_doors``, keyed by model,
variant and a hash of the sources they are built from (``models_zoo``, ``hand_rewrites``, and
``rocs_compiler`` for rocs; torch's version): a second run skips the compiles (``--fresh``
rebuilds). Inductor's own caches make a second ``torch.compile`` faster too.

Prints one Markdown table per door: milliseconds per call of each variant and ``hand / rocs``
(above 1: rocs is faster).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import argparse
import functools
import hashlib
import inspect
import json
import logging
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.export import Dim
from torch.fx import _pytree as fx_pytree

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from allocator import retain_freed_memory
from backend_door import _own_frame
from hand_rewrites import CASES, Case, self_check
from regression import WARMUP_CALLS, time_interleaved

import rocs_compiler as rocs
from models_zoo import Batch

DOORS = ("eager", "inductor", "aoti", "onnx")
VARIANTS = ("original", "hand", "rocs")
SIZES = ((1, 270), (1, 1024), (4, 270), (4, 1024))
CACHE = Path(tempfile.gettempdir()) / "rocs_doors"
TOLERANCE = 1e-4

Call = Callable[[], torch.Tensor]
Runner = Callable[[Batch], Call]  # prepares a batch's inputs, returns the call to time


# -- the three variants of a model -------------------------------------------------------------


@dataclass
class Subject:
    """One model: the original, its hand rewrite, its rocs.compile, and the example batch."""

    case: Case
    model: nn.Module
    hand: nn.Module
    cm: rocs.CompiledModel
    example: Batch

    @functools.cached_property
    def program(self):
        return rocs.export(self.cm, portable=True)

    @property
    def names(self) -> list[str]:
        return list(inspect.signature(self.model.forward).parameters)


def subject(case: Case) -> Subject:
    model = case.model()
    hand = case.rewrite(model).eval()
    example = case.make_batch([4, 3, 2], seed=1, shuffle=True)
    cm = rocs.compile(model, list(case.request_inputs), example_kwargs=example.replicated())
    return Subject(case, model, hand, cm, example)


def ragged_counts(requests: int, candidates: int) -> list[int]:
    """N split over R requests in proportions 1 : 2 : ... : R."""
    total = requests * (requests + 1) // 2
    counts = [candidates * (r + 1) // total for r in range(requests)]
    counts[-1] += candidates - sum(counts)
    return counts


def shared(batch: Batch) -> dict:
    return {**batch.kwargs, "candidate_to_request": batch.candidate_to_request}


def call_of(fn: Callable, inputs: Callable[[Batch], dict]) -> Runner:
    return lambda batch: functools.partial(fn, **inputs(batch))


def replicated(batch: Batch) -> dict:
    return batch.replicated()


# -- the doors: each maps a variant to a Runner, or to the error that stopped it ------------------


def eager_door(s: Subject) -> dict[str, Runner | str]:
    return {
        "original": call_of(s.model, replicated),
        "hand": call_of(s.hand, shared),
        "rocs": call_of(s.cm, shared),
    }


def inductor_door(s: Subject) -> dict[str, Runner | str]:
    tag = s.case.name
    original = torch.compile(_own_frame(s.model, s.names, f"{tag} original"), dynamic=True)
    hand_names = [*s.names, "candidate_to_request"]
    hand = torch.compile(_own_frame(s.hand, hand_names, f"{tag} hand"), dynamic=True)
    requests = list(s.case.request_inputs)
    door = torch.compile(
        _own_frame(s.model, s.names, f"{tag} rocs"),
        backend="rocs",
        options={"request_inputs": requests},
        dynamic=True,
    )
    return {
        "original": call_of(original, replicated),
        "hand": call_of(hand, shared),
        "rocs": call_of(functools.partial(rocs.shared_call, door, request_inputs=requests), shared),
    }


def aoti_door(s: Subject, fresh: bool) -> dict[str, Runner | str]:
    def package(variant: str, build: Callable[[Path], object]):
        path = cached(s, variant, "pt2", build, fresh)
        return torch._inductor.aoti_load_package(str(path))

    def plain(export: Callable[[Subject], object]) -> Callable[[Path], object]:
        return lambda path: torch._inductor.aoti_compile_and_package(
            export(s), package_path=str(path)
        )

    return built(
        {
            "original": lambda: call_of(package("original", plain(original_export)), replicated),
            "hand": lambda: call_of(package("hand", plain(hand_export)), shared),
            "rocs": lambda: call_of(
                package("rocs", lambda p: rocs.aoti_package(s.program, p)), shared
            ),
        }
    )


def onnx_door(s: Subject, fresh: bool) -> dict[str, Runner | str]:
    def plain(variant: str, export: Callable[[Subject], object], inputs: Callable[[Batch], dict]):
        path = cached(s, variant, "onnx", lambda p: _write_onnx(export(s), p), fresh)
        return onnx_runner(path, lambda batch: list(inputs(batch).values()))

    def ours():
        path = cached(s, "rocs", "onnx", lambda p: rocs.export_onnx(s.program, str(p)), fresh)
        spec = s.program.call_spec.in_spec
        return onnx_runner(
            path, lambda batch: fx_pytree.tree_flatten_spec(((), shared(batch)), spec)
        )

    return built(
        {
            "original": lambda: plain("original", original_export, replicated),
            "hand": lambda: plain("hand", hand_export, shared),
            "rocs": ours,
        }
    )


def built(makers: dict[str, Callable[[], Runner]]) -> dict[str, Runner | str]:
    """Each variant's runner, or its error kind (the traceback's last line goes to stderr)."""
    out = {}
    for variant, make in makers.items():
        start = time.perf_counter()
        try:
            out[variant] = make()
        except Exception as err:  # noqa: BLE001 - a failing door is a result, not a crash
            out[variant] = error_kind(err)
            report(variant, err)
        print(f"  {variant} ready in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return out


def error_kind(err: BaseException) -> str:
    return type(err).__name__


def report(what: str, err: BaseException) -> None:
    message = traceback.format_exception_only(err)[-1].strip()
    print(f"  {what}: {message[:300]}", file=sys.stderr)


# -- exports and the cache ----------------------------------------------------------------------


def _dims(names, request_inputs) -> dict:
    requests, candidates = Dim("R", min=1), Dim("N", min=1)
    return {n: {0: requests if n in request_inputs else candidates} for n in names}


def hand_export(s: Subject):
    """``torch.export`` of the hand rewrite, R and N dynamic."""
    inputs = shared(s.example)
    dims = _dims(inputs, s.case.request_inputs)
    with torch.no_grad():
        return torch.export.export(s.hand, (), inputs, dynamic_shapes=dims, strict=False)


def original_export(s: Subject):
    """``torch.export`` of the original model, its batch (every input's rows) one dynamic size."""
    inputs = replicated(s.example)
    dims = {n: {0: Dim("N", min=1)} for n in inputs}
    with torch.no_grad():
        return torch.export.export(s.model, (), inputs, dynamic_shapes=dims, strict=False)


def _write_onnx(program, path: Path) -> None:
    torch.onnx.export(program, (), dynamo=True, verbose=False).save(str(path))


def _source_hash(*folders: Path) -> str:
    digest = hashlib.sha256(torch.__version__.encode())
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def cached(s: Subject, variant: str, suffix: str, build: Callable[[Path], object], fresh: bool):
    """The file ``build(path)`` writes for this model and variant, built only when missing."""
    folders = [ROOT / "models_zoo", Path(__file__).parent / "hand_rewrites"]
    if variant == "rocs":
        folders.append(ROOT / "rocs_compiler")
    path = CACHE / f"{s.case.name}_{variant}_{_source_hash(*folders)}.{suffix}"
    if fresh or not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial." + suffix)
        build(partial)
        partial.replace(path)
    return path


def onnx_runner(path: Path, flat_inputs: Callable[[Batch], list]) -> Runner:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def runner(batch: Batch) -> Call:
        feeds = {n: t.numpy() for n, t in zip(names, flat_inputs(batch))}
        return lambda: torch.from_numpy(session.run(None, feeds)[0])

    return runner


# -- one door, measured ---------------------------------------------------------------------------


def measure(door: dict[str, Runner | str], s: Subject, sizes, args) -> list[dict]:
    """One row per size: each variant's milliseconds per call, or why it has none."""
    rows = []
    for requests, candidates in sizes:
        counts = ragged_counts(requests, candidates)
        batch = s.case.make_batch(counts, seed=candidates + requests, shuffle=True)
        cells, calls = ready_calls(door, batch, expected(s, batch), f"{requests}x{candidates}")
        with torch.no_grad():
            times = time_interleaved(calls, args.repeats, args.sample_ms / 1e3, time.thread_time)
        for variant, seconds in times.items():
            cells[variant] = (cells[variant] or "") + f"{seconds * 1e3:.3f}"
        rows.append({"model": s.case.name, "R": requests, "N": candidates, **cells})
        print(f"  {requests}x{candidates}: {cells}", file=sys.stderr, flush=True)
    return rows


@torch.no_grad()
def expected(s: Subject, batch: Batch) -> torch.Tensor:
    """The original model's eager output; the hand rewrite must equal it before any timing."""
    want = s.model(**batch.replicated())
    torch.testing.assert_close(s.hand(**shared(batch)), want, rtol=TOLERANCE, atol=TOLERANCE)
    return want


def ready_calls(door: dict[str, Runner | str], batch: Batch, want, where: str):
    """``(cells, calls)``: each variant's call, warmed up and checked against ``want``; a cell
    holds a variant's error kind, or ``"! "`` when its output differs."""
    cells, calls = {}, {}
    for variant, runner in door.items():
        cells[variant] = runner if isinstance(runner, str) else None
        if isinstance(runner, str):
            continue
        try:
            calls[variant] = checked(runner(batch), want, variant, cells)
        except Exception as err:  # noqa: BLE001 - a failing call is a result, not a crash
            cells[variant] = error_kind(err)
            report(f"{variant} at {where}", err)
    return cells, calls


@torch.no_grad()
def checked(call: Call, want: torch.Tensor, variant: str, cells: dict) -> Call:
    """Compare with the original, warm up (program choice, Inductor's recompile), compare again."""
    outs = [call() for _ in range(WARMUP_CALLS if variant == "rocs" else 3)]
    for out in (outs[0], outs[-1]):
        if not torch.allclose(out, want, rtol=TOLERANCE, atol=TOLERANCE):
            cells[variant] = "! "
            error = (out - want).abs().max().item()
            print(f"  ! {variant} differs from the original by {error:.3g}", file=sys.stderr)
    return call


def table(door: str, rows: list[dict]) -> str:
    lines = [
        f"**{door}**",
        "",
        "| model | R | N | original ms | hand ms | rocs ms | hand / rocs |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = [row.get(v) or "" for v in VARIANTS]
        lines.append(f"| {row['model']} | {row['R']} | {row['N']} | {' | '.join(cells)} | "
                     f"{ratio(row['hand'], row['rocs'])} |")  # fmt: skip
    return "\n".join(lines)


def ratio(hand: str | None, ours: str | None) -> str:
    try:
        return f"{float(hand.lstrip('! ')) / float(ours.lstrip('! ')):.2f}"
    except (AttributeError, ValueError):
        return "n/a"


def open_door(door: str, s: Subject, fresh: bool) -> dict[str, Runner | str]:
    if door == "eager":
        return eager_door(s)
    if door == "inductor":
        return inductor_door(s)
    if door == "aoti":
        return aoti_door(s, fresh)
    return onnx_door(s, fresh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--doors", default=",".join(DOORS))
    parser.add_argument("--sizes", default=",".join(f"{r}x{n}" for r, n in SIZES))
    parser.add_argument("--repeats", type=int, default=15, help="rounds per cell")
    parser.add_argument("--sample-ms", type=float, default=20.0)
    parser.add_argument("--fresh", action="store_true", help="rebuild cached packages")
    parser.add_argument("--json", default=None)
    parser.add_argument("--self-check", action="store_true", help="check the rewrites, exit")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    if args.self_check:
        self_check(args.models.split(","))
        print("every hand rewrite equals its model on ragged batches")
        return
    sizes = [tuple(int(x) for x in size.split("x")) for size in args.sizes.split(",")]
    torch.set_num_threads(1)
    retain_freed_memory()
    for logger in ("torch.onnx", "onnxscript", "onnx_ir"):  # the exporter's progress notes
        logging.getLogger(logger).setLevel(logging.ERROR)
    rows = {door: [] for door in args.doors.split(",")}
    for name in args.models.split(","):
        start = time.perf_counter()
        s = subject(CASES[name])
        print(f"{name}: compiled in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        for door in rows:
            print(f"{name}, {door}:", file=sys.stderr, flush=True)
            rows[door] += measure(open_door(door, s, args.fresh), s, sizes, args)
    for door, door_rows in rows.items():
        print(table(door, door_rows), end="\n\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
