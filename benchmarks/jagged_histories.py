"""Jagged histories: a batch whose histories are padded to its longest one, run padded and as
jagged calls (requests grouped by length, each group cut to its longest).

    OMP_NUM_THREADS=1 python benchmarks/jagged_histories.py [--repeats 6] [--candidates 8]
        [--training] [--door {rocs,inductor,export,aoti,onnx}]

DIN (``models_zoo/din.py``), compiled once with its history length marked dynamic. One call:
one request with a history of 2,048 events and 63 with 30 events each (``--short``), padded with
0 to 2,048, ``--candidates`` candidates per request. One thread, interleaved rounds, medians:

- ``eager``: the original model on the replicated, padded batch;
- ``rocs padded``: the compiled model with jagged calls off (``options={"jagged": False}``);
- ``rocs jagged``: the compiled model as it is: the truncation proof (``analysis/truncation.py``)
  shows DIN ignores its padding, so the call runs as groups (``runtime/call/jagged.py``).

Every output is checked against eager first. Then the same at a few other tails: the longest
history at 256 and 512, and histories uniform over 1..2,048. ``--training`` times a training
step instead (training compiles; forward and backward of the outputs' sum). ``--door inductor``
times the same through ``torch.compile(model, backend=rocs.backend(...), dynamic=True)``, called
with ``rocs.shared_call`` (the rewrite lowered with Inductor; "eager" stays the original model).
``--door export`` times the saved program (``rocs.export``, ``rocs.save``, ``rocs.load``): padded
is its module called directly, jagged the loaded program, which cuts its calls by the plan the
export carries (``export/jagged_program.py``); ``--door aoti`` the AOTInductor package of the
portable program (the runner, and ``rocs.JaggedProgram`` over it), ``--door onnx`` its ONNX model
in ONNX Runtime (one thread; the session, and ``rocs.JaggedProgram`` over it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rocs_compiler as rocs  # noqa: E402
from models_zoo import din  # noqa: E402
from rocs_compiler.timing import interleaved_medians  # noqa: E402

HISTORIES = ("hist_item_ids", "hist_cat_ids")


def _compiled(model, jagged: bool, training: bool):
    example = din.make_batch([4, 3]).replicated()
    for name in HISTORIES:
        torch._dynamo.mark_dynamic(example[name], 1)
    options = {"jagged": jagged}
    return rocs.compile(
        model, list(din.REQUEST_INPUTS), example_kwargs=example, options=options,
        training=training,
    )  # fmt: skip


class _Door:
    """``torch.compile(model, backend=rocs.backend(...))`` called in shared layout, as the
    compiled model is (``--door inductor``)."""

    def __init__(self, model, jagged: bool):
        self.backend = rocs.backend(list(din.REQUEST_INPUTS), jagged=jagged)
        self.compiled = torch.compile(model, backend=self.backend, dynamic=True)
        for length in (16, 40):  # the rewrite takes the length dynamic at its second value
            kwargs, index = _call(torch.full((4,), length), 2, seed=length)
            self(**kwargs, candidate_to_request=index)

    def __call__(self, candidate_to_request, **kwargs):
        return rocs.shared_call(self.compiled, **kwargs, candidate_to_request=candidate_to_request)

    @property
    def _jagged(self):
        runners = [v.runner for s in self.backend.subgraphs for v in s.variants.values()]
        return next(r._jagged for r in runners if getattr(r, "_jagged", None) is not None)


class _Program:
    """An exported program's door, padded (the program called as it is) or jagged (cut by the
    plan the export carries): ``--door export``, ``aoti`` or ``onnx``."""

    def __init__(self, run, plan, jagged: bool):
        self._jagged = rocs.JaggedProgram(run, plan)
        self._run = self._jagged if jagged else run

    def __call__(self, candidate_to_request, **kwargs):
        return self._run(**kwargs, candidate_to_request=candidate_to_request)


def _program_doors(model, door: str, where: Path) -> tuple[_Program, _Program]:
    """(padded, jagged) for ``door``, from DIN compiled with its length dynamic."""
    cm = _compiled(model, True, False)
    if door == "export":
        rocs.save(rocs.export(cm), where / "din.pt2")
        loaded = rocs.load(where / "din.pt2")
        run, plan = loaded.module(), rocs.jagged_plan(loaded)
    elif door == "aoti":
        package = rocs.aoti_package(rocs.export(cm, portable=True), where / "din_aoti.pt2")
        run = torch._inductor.aoti_load_package(package)
        plan = rocs.jagged_plan(run.get_metadata())
    else:
        import onnxruntime as ort

        path = rocs.export_onnx(rocs.export(cm, portable=True), where / "din.onnx")
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]

        def run(**feeds):
            return torch.from_numpy(session.run(None, {n: feeds[n].numpy() for n in names})[0])

        plan = rocs.jagged_plan(session.get_modelmeta().custom_metadata_map)
    return _Program(run, plan, False), _Program(run, plan, True)


def _step(fn, training: bool):
    """``fn`` as one timed call: a forward, and under ``training`` its backward too."""
    if not training:
        return fn

    def step():
        fn().sum().backward()

    return step


def _call(lengths: torch.Tensor, candidates: int, seed: int):
    """Shared-layout inputs: request r has ``lengths[r]`` events, padded to the longest."""
    requests = lengths.shape[0]
    batch = din.make_batch([candidates] * requests, seed=seed, shuffle=True)
    g = torch.Generator().manual_seed(seed)
    width = int(lengths.max())
    kwargs = dict(batch.kwargs)
    for name, vocab in zip(HISTORIES, (din.NUM_ITEMS, din.NUM_CATS)):
        ids = torch.randint(1, vocab, (requests, width), generator=g)
        kwargs[name] = ids.masked_fill(torch.arange(width) >= lengths[:, None], 0)
    return kwargs, batch.candidate_to_request


def _tails(short: int):
    g = torch.Generator().manual_seed(0)
    one_long = torch.full((64,), short)
    one_long[0] = 2048
    yield "1 x 2048 + 63 x %d" % short, one_long
    for longest in (256, 512):
        t = torch.full((64,), short)
        t[0] = longest
        yield f"1 x {longest} + 63 x {short}", t
    yield "64 uniform in 1..2048", torch.randint(1, 2049, (64,), generator=g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--candidates", type=int, default=8)
    parser.add_argument("--short", type=int, default=30)
    parser.add_argument("--training", action="store_true", help="time training steps")
    parser.add_argument(
        "--door", choices=("rocs", "inductor", "export", "aoti", "onnx"), default="rocs",
        help="rocs.compile, torch.compile(backend=rocs.backend(...)) through rocs.shared_call, "
        "or an exported program: saved, AOTInductor package, ONNX Runtime",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = din.build(seed=0).eval()
    if args.door != "rocs" and args.training:
        parser.error("--training times rocs.compile's training compiles only")
    if args.door == "inductor":
        with torch.no_grad():
            padded, jagged = _Door(model, False), _Door(model, True)
    elif args.door != "rocs":
        where = Path(tempfile.mkdtemp(prefix="rocs_jagged_"))
        padded, jagged = _program_doors(model, args.door, where)
    else:
        padded = _compiled(model, False, args.training)
        jagged = _compiled(model, True, args.training)
    what = "training steps (forward and backward)" if args.training else "calls"
    door = {
        "inductor": "torch.compile(backend=rocs)", "export": "a saved program (rocs.load)",
        "aoti": "an AOTInductor package", "onnx": "ONNX Runtime",
    }.get(args.door, "rocs.compile")  # fmt: skip
    print(f"DIN through {door}, 64 requests x {args.candidates} candidates, one thread, medians of "
          f"{args.repeats} interleaved {what}\n")  # fmt: skip
    print("| histories | eager ms | rocs padded ms | rocs jagged ms | jagged vs padded "
          "| jagged vs eager | max diff |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, lengths in _tails(args.short):
        kwargs, index = _call(lengths, args.candidates, seed=int(lengths.sum()))
        replicated = {n: v[index] if n in din.REQUEST_INPUTS else v for n, v in kwargs.items()}
        grad = torch.enable_grad() if args.training else torch.no_grad()
        with grad:
            want = model(**replicated)
            diff = max(
                (padded(**kwargs, candidate_to_request=index) - want).abs().max(),
                (jagged(**kwargs, candidate_to_request=index) - want).abs().max(),
            )
            split = jagged._jagged.split_calls
            calls = {
                "eager": lambda: model(**replicated),
                "padded": lambda: padded(**kwargs, candidate_to_request=index),
                "jagged": lambda: jagged(**kwargs, candidate_to_request=index),
            }
            steps = {name: _step(fn, args.training) for name, fn in calls.items()}
            ms = interleaved_medians(steps, args.repeats)
        assert split > 0, "the jagged compile did not split the call"
        print(f"| {label} | {ms['eager']:.1f} | {ms['padded']:.1f} | {ms['jagged']:.1f} "
              f"| {ms['padded'] / ms['jagged']:.1f}x | {ms['eager'] / ms['jagged']:.1f}x "
              f"| {float(diff):.1e} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
