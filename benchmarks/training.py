"""Training benchmark: one training step, eager on replicated rows vs the training compile.

For each model and each number of impressions per request k, a batch of R requests with k
impressions each is built, and one training step is timed two ways:

- ``eager``: ``model(**batch.replicated())``, the loss, ``backward()``, ``optimizer.step()``;
- ``rocs``: the same step through ``cm = rocs.compile(model, ..., training=True)`` in the shared
  layout (``cm(**batch.kwargs, candidate_to_request=idx)``), the model's own parameters; after
  ``WARMUP`` calls, through the program choice's trials, each bucket runs the program it kept
  (the training program or the original model, column **runs**);
- ``program``: the same with ``options={"autotune": False}``: the training program always.

The optimizer is SGD with learning rate 0 (its step costs what a step costs; the weights stay put,
so every round times the same computation). The process keeps freed CPU memory (``--malloc
retain``, the default, ``allocator.py``): with glibc's malloc as it is, each step's zero-filled
dense table gradients (6.4 MB for a 50000 x 32 table) land on fresh pages and fault them in,
about 5 ms per table per step on this machine, in every variant alike.

Timing: each round runs every variant for ``--block`` consecutive steps, as a training loop calls
one model step after step, in a fresh random order of variants (a fixed rotation would always put
the same variant after the training program); the first step of a block, which follows another
variant's step, is not counted. The reported time is the median of the counted steps over
``--repeats`` rounds. With one torch thread (the default) steps are timed by the thread's CPU
time, which time spent preempted by other processes on a shared machine does not inflate (a CPU
step's forward and backward both run on the calling thread); with more threads, by wall time.
Columns:

- **speedup**: eager time / rocs time (**program speedup**: eager time / program time);
- **ideal**: ``cm.report(candidates=k, requests=R).ideal_speedup()``, the forward FLOP
  ratio. A backward op costs about twice its forward and is shared exactly as its forward is,
  so the forward+backward ratio equals it under that approximation;
- **efficiency**: speedup / ideal;
- **floor ms**: the part of eager's step that does not depend on the batch's rows and that no
  sharing can remove: the optimizer's step over every parameter and the zero-filled dense
  gradient of each embedding table (``embedding_dense_backward`` starts from zeros of the
  table's size), timed right after an eager step (its gradients in place);
- **attainable**: the speedup if the rest of eager's step shrank by the FLOP ideal,
  ``eager / (floor + (eager - floor) / ideal)``; **of attainable**: speedup / attainable.
- **eager+gather ms**: eager for a caller whose batch is in the shared layout, the request rows
  gathered to one per impression first (``batch.replicated()`` inside the step); **speedup vs
  eager+gather**: that time / rocs time, what such a caller saves;
- **drop-in ms**: the same step through ``cm(**batch.replicated())``, the impression-level batch
  eager takes (its requests found by the compiled model), **drop-in runs** the program its bucket
  kept, **drop-in speedup**: eager time / drop-in time;
- **A/A**: eager time / the time of the same eager step run as a variant of its own: how far two
  identical variants land apart in this run (the noise a ratio above is read against);
- **DDP eager ms / DDP rocs ms / DDP speedup** (``--ddp``): one step per rank of
  ``DDP(model)`` and ``DDP(rocs.compile(model, ..., training=True))`` on 2 ranks (gloo,
  127.0.0.1), wall time, all-reduce included; **DDP ... cpu ms**: the same steps by the calling
  thread's CPU time, the all-reduce (gloo's own threads) excluded (``training_ddp.py``);
- **saved MB**: bytes of the tensors autograd saved for the backward (distinct storages other
  than the model's weights, counted with ``torch.autograd.graph.saved_tensors_hooks``), eager /
  the training program: the activations of request rows are kept per request.

Each step's loss is compared with eager's once per shape; a mismatch is printed.

Usage::

    python benchmarks/training.py                              # default models, k in 1 4 16 64
    python benchmarks/training.py --models dlrm --ks 1 16 --requests 4 --repeats 5
    python benchmarks/training.py --quick --json out.json      # tiny sizes (for tests)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rocs_compiler as rocs
from allocator import retain_freed_memory
from rocs_compiler.runtime.choice.program_choice import bucket
from training_models import WARMUP, build, loss_of

DEFAULT_MODELS = ["two_tower", "din", "dlrm", "glm:dcnv2", "dca:bst"]
def saved_bytes(step, weights: set[int]) -> int:
    """Bytes of the distinct storages autograd saves for the backward during ``step()``'s
    forward (the step's backward frees them), the model's own weights (storages ``weights``)
    not counted: they exist anyway."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


def measure(
    name: str,
    ks: list[int],
    requests: int,
    repeats: int,
    request_dropout: str = "per_impression",
    block: int = 3,
) -> list[dict]:
    model, entry = build(name)
    example = entry.make_batch([2, 3], seed=1).replicated()
    compiled = {
        v: rocs.compile(
            model, list(entry.request_inputs), example_kwargs=example, training=True,
            options={"autotune": v == "rocs", "request_dropout": request_dropout},
        )
        for v in ("rocs", "program")
    }  # fmt: skip
    cm = compiled["rocs"]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rows = []
    for k in ks:
        batch = entry.make_batch([k] * requests, seed=2)
        replicated = batch.replicated()
        results = {}

        def eager_step(replicated=replicated, call=model):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(call(**replicated))
            loss.backward()
            opt.step()
            return float(loss)

        def compiled_step(variant, batch=batch):
            opt.zero_grad(set_to_none=True)
            call = compiled[variant]
            loss = loss_of(call(**batch.kwargs, candidate_to_request=batch.candidate_to_request))
            loss.backward()
            opt.step()
            return float(loss)

        steps = {
            "eager": eager_step,
            "rocs": lambda: compiled_step("rocs"),
            "program": lambda: compiled_step("program"),
            "dropin": lambda: eager_step(call=cm),  # the impression-level batch, compiled
            "eager_again": eager_step,  # the same step as "eager": the A/A column, the noise
            # eager for a caller holding the shared layout: the request rows gathered first
            "eager_gather": lambda batch=batch: eager_step(batch.replicated()),
        }
        floor = floor_of(model, opt)
        losses = {}
        for v, step in steps.items():  # warm-up and the loss check, one seed each (dropout alike)
            for _ in range(WARMUP):
                torch.manual_seed(0)
                losses[v] = step()
        for v in ("rocs", "program", "dropin") if request_dropout == "per_impression" else ():
            if abs(losses["eager"] - losses[v]) > 1e-3 * max(1.0, abs(losses["eager"])):
                print(f"MISMATCH {name} k={k}: eager loss {losses['eager']}, {v} {losses[v]}",
                      file=sys.stderr)  # fmt: skip
        times = {v: [] for v in [*steps, "floor"]}
        clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
        shuffler = random.Random(k)
        for _ in range(repeats):
            order = list(steps)
            shuffler.shuffle(order)  # no variant always follows the same one
            for v in order:
                for counted in [False] + [True] * block:
                    start = clock()
                    steps[v]()
                    if counted:
                        times[v].append(clock() - start)
                if v == "eager":  # its gradients are in place: what the optimizer steps over
                    start = clock()
                    floor()
                    times["floor"].append(clock() - start)
        for v in times:
            results[v] = statistics.median(times[v])
        weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        saved = {v: saved_bytes(steps[v], weights) for v in ("eager", "rocs", "program")}
        ideal = cm.report(candidates=k, requests=requests).ideal_speedup()
        speedup = results["eager"] / results["rocs"]
        fixed = min(results["floor"], results["eager"])
        attainable = results["eager"] / (fixed + (results["eager"] - fixed) / ideal)
        choices = cm.program_choices()
        names = {"plain": "eager", "shared": "program", None: "program (no choice)"}
        runs = names[choices.get(bucket("train-shared", requests * k, requests))]
        dropin_runs = names[choices.get(bucket("train-dropin", requests * k, requests))]
        rows.append(
            {
                "model": name, "requests": requests, "k": k, "eager_ms": 1e3 * results["eager"],
                "rocs_ms": 1e3 * results["rocs"], "speedup": speedup, "ideal": ideal,
                "program_ms": 1e3 * results["program"],
                "program_speedup": results["eager"] / results["program"], "runs": runs,
                "efficiency": speedup / ideal, "eager_saved_mb": saved["eager"] / 2**20,
                "floor_ms": 1e3 * results["floor"], "attainable": attainable,
                "eager_gather_ms": 1e3 * results["eager_gather"],
                "speedup_vs_gather": results["eager_gather"] / results["rocs"],
                "dropin_ms": 1e3 * results["dropin"], "dropin_runs": dropin_runs,
                "dropin_speedup": results["eager"] / results["dropin"],
                "a_a": results["eager"] / results["eager_again"],
                "of_attainable": speedup / attainable,
                "rocs_saved_mb": saved["rocs"] / 2**20,
                "program_saved_mb": saved["program"] / 2**20,
                "loss_diff": max(
                    abs(losses["eager"] - losses[v]) for v in ("rocs", "program", "dropin")
                ),
            }
        )  # fmt: skip
    return rows


def floor_of(model: torch.nn.Module, opt: torch.optim.Optimizer):
    """The step's work that no sharing removes (module docstring, **floor ms**): a function
    that zero-fills a gradient the size of each dense embedding table and steps ``opt``."""
    tables = [
        m.weight for m in model.modules()
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and not m.sparse
        and m.weight.requires_grad
    ]  # fmt: skip

    def floor():
        for table in tables:
            torch.zeros_like(table)
        opt.step()

    return floor


def markdown(rows: list[dict]) -> str:
    lines = [
        (
            "| model | R | k | eager ms | program ms | program speedup | rocs ms | runs | speedup "
            "| eager+gather ms | speedup vs eager+gather | drop-in ms | drop-in runs | drop-in speedup | A/A "
            "| ideal | efficiency | floor ms | attainable | of attainable "
            "| saved MB eager / program |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ddp = any("ddp_eager_wall_ms" in r for r in rows)
    if ddp:
        lines[0] += " DDP eager ms | DDP rocs ms | DDP speedup | DDP eager cpu ms | DDP rocs cpu ms | DDP cpu speedup |"
        lines[1] += "---|---|---|---|---|---|"
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['requests']} | {r['k']} | {r['eager_ms']:.2f} "
            f"| {r['program_ms']:.2f} | {r['program_speedup']:.2f}x | {r['rocs_ms']:.2f} "
            f"| {r['runs']} | {r['speedup']:.2f}x | {r['eager_gather_ms']:.2f} "
            f"| {r['speedup_vs_gather']:.2f}x | {r['dropin_ms']:.2f} | {r['dropin_runs']} "
            f"| {r['dropin_speedup']:.2f}x | {r['a_a']:.2f} | {r['ideal']:.2f}x | {r['efficiency']:.2f} "
            f"| {r['floor_ms']:.2f} | {r['attainable']:.2f}x | {r['of_attainable']:.2f} "
            f"| {r['eager_saved_mb']:.2f} / {r['program_saved_mb']:.2f} |"
        )
        if ddp:
            for clock in ("wall", "cpu"):
                eager, compiled = r[f"ddp_eager_{clock}_ms"], r[f"ddp_rocs_{clock}_ms"]
                lines[-1] += f" {eager:.2f} | {compiled:.2f} | {eager / compiled:.2f}x |"
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--block", type=int, default=3,
        help="counted steps per variant per round, after one uncounted step (module docstring)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats (for tests)")
    parser.add_argument(
        "--request-dropout", choices=["per_impression", "per_request"], default="per_impression",
        help="the compiled variants' option (per_request changes the model: losses then differ "
        "from eager's, and the eager column is the model as written)",
    )  # fmt: skip
    parser.add_argument(
        "--malloc", choices=("retain", "system"), default="retain",
        help="keep freed CPU memory in the process (default; see allocator.py: without it the "
        "zero-filled table gradients of every step fault in fresh pages, in eager and rocs "
        "alike) or leave glibc's malloc as it is",
    )  # fmt: skip
    parser.add_argument(
        "--ddp", action="store_true", help="add the DDP columns (2 ranks, training_ddp.py)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.ks, args.requests, args.repeats, args.block = [1, 4], 2, 2, 1
    torch.set_num_threads(args.threads)
    retained = args.malloc == "retain" and retain_freed_memory()
    print(f"malloc: {'glibc, freed memory retained' if retained else 'as the process found it'}")
    rows = []
    for name in args.models:
        measured = measure(
            name, args.ks, args.requests, args.repeats, args.request_dropout, args.block
        )
        if args.ddp:
            from training_ddp import ddp_times

            times = ddp_times(name, args.ks, args.requests, args.repeats, args.block)
            for row in measured:
                row.update(times[row["k"]])
        rows += measured
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
