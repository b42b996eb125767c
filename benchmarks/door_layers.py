"""The torch.compile door's time per call, layer by layer (issue #49).

    OMP_NUM_THREADS=1 python benchmarks/door_layers.py [--models dlrm,glm_dcnv2,...]
        [--sizes 1x270,4x1024] [--rounds 9] [--sample-ms 100]

For each model of ``doors.py`` (the same subjects, ragged batches and hand rewrites), one process,
one thread, glibc's malloc keeping freed memory (``allocator.py``), the calling thread's CPU time,
medians of ``--rounds`` rounds of loops of at least ``--sample-ms``, the variants interleaved
round by round (``regression.time_interleaved``):

- **door, on / off**: ``rocs.shared_call`` of ``torch.compile(model, backend=rocs.backend(...),
  dynamic=True)``, with the compiled frames of the lowered graphs (``backend/compiled_frame.py``)
  and of the user's model (``backend/user_frame.py``), and with both swapped for ones that always
  miss (every call through ``torch.compile``'s own call);
- **door, as before**: a second door of the same model whose frames dynamo guards with its
  default guards (every parameter checked) rather than the recursive dict tags ``shared_call``
  compiles with (``backend/user_frame.py``), and whose lowered graphs keep Inductor's input
  asserts (``backend/lowering.py``), frames on;
- **hand**: ``torch.compile(hand rewrite, dynamic=True)`` on the shared layout; **hand, tags**:
  the same, its guards built with the recursive dict tags (what an expert gets from the flag);
- **cm**: ``rocs.compile``'s eager call on the shared layout.

Then the door's layers: ``shared_call`` alone (the user's frame replaced by one that returns a
cached output), the user's frame and ``shared_call`` (the subgraph replaced so), the subgraph
alone (called with the arguments dynamo handed it, inside the same shared-call state), each *hot*
(timed alone) and *cold* (after touching 8 MB, as the call's own kernels evict what the next layer
reads; the 8 MB pass's own time taken off); and the lowered graphs' code alone, hot: the code of
the cache entry each runs, called with the arguments it got, without its guard check (what the
door's kernels cost with dynamo's bytecode around them, to set against the hand rewrite's whole
call). "door - code" is what the door's layers cost in the door's call. Last, the guard checks
in real calls: the user's frame's (part of its layer) and the hand rewrite's frame's, its
compiled entry run as the door runs the user's (``CompiledFrame``), each timed around the check.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import doors  # noqa: E402
import rocs_compiler as rocs  # noqa: E402
from backend_door import _own_frame  # noqa: E402
from hand_rewrites import CASES  # noqa: E402
from regression import time_interleaved  # noqa: E402
from rocs_compiler.backend import door as door_module, lowering, user_frame  # noqa: E402
from rocs_compiler.backend.compiled_frame import MISS, CompiledFrame  # noqa: E402
from rocs_compiler.backend.lowering import Lowered  # noqa: E402
from rocs_compiler.backend.subgraph import SHARED_CALL, Subgraph  # noqa: E402
from rocs_compiler.backend.user_frame import call_compiled  # noqa: E402


class _AlwaysMiss:
    """A compiled frame that accepts no call: the door as it was before the compiled frame."""

    def __call__(self, args):
        return MISS

    def missed(self) -> None:
        pass


def _interleaved_us(calls: dict, rounds: int, sample_s: float) -> dict:
    seconds = time_interleaved(calls, rounds, sample_s, time.thread_time)
    return {name: value * 1e6 for name, value in seconds.items()}


def _lowered_graphs(backend) -> list[Lowered]:
    found = [v.runner.graph_module for s in backend.subgraphs for v in s.variants.values()]
    found += [s.plain for s in backend.subgraphs]
    return [g for g in found if isinstance(g, Lowered)]


def _through_torch_compile(compiled, args: tuple, kwargs: dict):
    return compiled(*args, **kwargs)


def _compiled_as_before(compile_and_warm):
    """What ``compile_and_warm()`` returns, its frames guarded by dynamo's default guards (every
    parameter's checks) rather than the recursive dict tags ``shared_call`` compiles with, and its
    lowered graphs' Inductor code with its input asserts (the door before 2026-12-07)."""
    tags, user_frame._recursive_dict_tags = user_frame._recursive_dict_tags, contextlib.nullcontext
    inductor = dict(lowering._INDUCTOR)
    lowering._INDUCTOR.clear()
    try:
        return compile_and_warm()
    finally:
        user_frame._recursive_dict_tags = tags
        lowering._INDUCTOR.update(inductor)


def _door_as_before(s, request_inputs: list, inputs: dict):
    door = torch.compile(
        _own_frame(s.model, s.names, "door, as before"), backend=rocs.backend(request_inputs),
        dynamic=True,
    )  # fmt: skip

    def warm():
        for _ in range(3):  # dynamo traces the frame at the first call
            rocs.shared_call(door, request_inputs=request_inputs, **inputs)

    _compiled_as_before(warm)
    return lambda: rocs.shared_call(door, request_inputs=request_inputs, **inputs)


def _hand_with_tags(s, inputs: dict):
    """The hand rewrite through ``torch.compile``, its guards built with recursive dict tags."""
    names = [*s.names, "candidate_to_request"]
    hand = torch.compile(_own_frame(s.hand, names, "hand, tags"), dynamic=True)
    with torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True):
        for _ in range(3):
            hand(**inputs)
    return lambda: hand(**inputs)


def measure(name: str, requests: int, candidates: int, rounds: int, sample_s: float) -> dict:
    s = doors.subject(CASES[name])
    request_inputs = list(s.case.request_inputs)
    backend = rocs.backend(request_inputs)
    door = torch.compile(_own_frame(s.model, s.names, "door"), backend=backend, dynamic=True)
    hand_names = [*s.names, "candidate_to_request"]
    hand = torch.compile(_own_frame(s.hand, hand_names, "hand"), dynamic=True)
    batch = s.case.make_batch(doors.ragged_counts(requests, candidates), seed=7, shuffle=True)
    inputs = doors.shared(batch)

    def call_door():
        return rocs.shared_call(door, request_inputs=request_inputs, **inputs)

    with torch.no_grad():
        for _ in range(3):
            call_door(), hand(**inputs), s.cm(**inputs)
        torch.testing.assert_close(call_door(), hand(**inputs), rtol=1e-4, atol=1e-4)
        before = _door_as_before(s, request_inputs, inputs)
        torch.testing.assert_close(before(), hand(**inputs), rtol=1e-4, atol=1e-4)
        hand_tags = _hand_with_tags(s, inputs)
        lowered = _lowered_graphs(backend)
        frames = [g._frame for g in lowered]

        def with_frames(on: bool, call=call_door):
            def switched():
                for graph, frame in zip(lowered, frames):
                    graph._frame = frame if on else _AlwaysMiss()
                door_module.call_compiled = call_compiled if on else _through_torch_compile
                return call()

            return switched

        # Switching frames costs the same in each, and far less than a call.
        times = _interleaved_us(
            {"door, off": with_frames(False), "door, on": with_frames(True),
             "door, as before": with_frames(True, before),
             "hand": lambda: hand(**inputs), "hand, tags": hand_tags, "cm": lambda: s.cm(**inputs)},
            rounds, sample_s,
        )  # fmt: skip
        for graph, frame in zip(lowered, frames):
            graph._frame = frame
        door_module.call_compiled = call_compiled
        times.update(_layers(call_door, lowered, rounds, sample_s, user_frame._FRAMES[door]))
        times["hand guards"] = _hand_guards(hand, inputs, rounds, sample_s)
    return times


def _layers(call_door, lowered: list, rounds: int, sample_s: float, user) -> dict:
    """The user's frame with ``shared_call``, and the subgraph, hot and cold; then the door's
    call split by where its time goes (:func:`_in_call`)."""
    seen = {}
    real = Subgraph.__call__

    def spy(self, *args):
        seen.setdefault("subgraph", (self, args, SHARED_CALL.get()))
        return real(self, *args)

    Subgraph.__call__ = spy
    try:
        call_door()
    finally:
        Subgraph.__call__ = real
    subgraph, args, state = seen["subgraph"]
    cached = real(subgraph, *args)

    def stub(self, *args):
        SHARED_CALL.get().graphs_shared += 1
        return cached

    def call_subgraph():
        token = SHARED_CALL.set(state)
        try:
            return subgraph(*args)
        finally:
            SHARED_CALL.reset(token)

    evict = torch.zeros(2_000_000)  # 8 MB, past this machine's L2 and most of its L3

    def hot_and_cold(call) -> tuple[float, float]:
        t = _interleaved_us(
            {"evict": lambda: evict.add_(0.0), "hot": call,
             "cold": lambda: (evict.add_(0.0), call())},
            rounds, sample_s,
        )  # fmt: skip
        return t["hot"], t["cold"] - t["evict"]

    Subgraph.__call__ = stub
    try:
        frame_hot, frame_cold = hot_and_cold(call_door)
    finally:
        Subgraph.__call__ = real
    sub_hot, sub_cold = hot_and_cold(call_subgraph)
    in_call = _in_call(call_door, lowered, rounds, sample_s, user)
    return {"frame hot": frame_hot, "frame cold": frame_cold, "sub hot": sub_hot,
            "sub cold": sub_cold, **in_call}  # fmt: skip


# The door's nested layers, outermost first: what each wrapper times includes the next.
_NESTED = ("shared_call", "user frame", "subgraph", "lowered frame", "code")


def _timed(spent: dict, label: str, fn):
    """``fn``, its calls adding their time on the thread's CPU clock to ``spent[label]``."""

    def run(*args, **kwargs):
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] += time.thread_time() - start

    return run


def _timed_guards(entries: list, spent: dict, label: str) -> list:
    """A compiled frame's entries whose guard checks add their time to ``spent[label]``."""
    return [
        (SimpleNamespace(check=_timed(spent, label, guards.check)), run, direct)
        for guards, run, direct in entries
    ]


def _hand_guards(hand, inputs: dict, rounds: int, sample_s: float) -> float:
    """Microseconds per call the hand rewrite's frame spends in its guard check, in real calls of
    its compiled entry (run as the door runs the user's frame: ``CompiledFrame``)."""
    frame = CompiledFrame(hand._orig_mod)
    frame.refresh()
    spent = {"guards": 0.0}
    frame._entries = _timed_guards(frame._entries, spent, "guards")
    assert frame.call((), inputs) is not MISS
    loops = max(1, round(sample_s / max(_seconds(lambda: frame.call((), inputs)), 1e-7)))
    samples = []
    for _ in range(rounds):
        spent["guards"] = 0.0
        for _ in range(loops):
            frame.call((), inputs)
        samples.append(spent["guards"] / loops * 1e6)
    return statistics.median(samples) - 2 * _clock_read_us()


def _in_call(call_door, lowered: list, rounds: int, sample_s: float, user: CompiledFrame) -> dict:
    """Microseconds per door call spent in ``shared_call`` outside the user's frame, in the
    user's frame outside the subgraph (its guards and code), in the subgraph outside the lowered
    graph (its checks, the settled call), in the lowered graph's frame outside its entry's code
    (``Lowered``'s preparation, the entry's guards), and in that code (dynamo's bytecode and
    Inductor's): each layer timed by the thread's CPU clock around it, inside real calls, so with
    the caches as the call's own kernels leave them; the clock's reads are taken off the layer
    they fall in, what is left of the timers (a Python call each) is under a microsecond per
    layer. Medians of ``rounds`` loops."""
    spent = dict.fromkeys((*_NESTED, "user guards"), 0.0)

    def timed(label: str, fn):
        return _timed(spent, label, fn)

    frames = [g._frame for g in lowered if g._frame is not None]
    entries = [frame._entries for frame in frames]
    real_forward, real_subgraph = Lowered.forward, Subgraph.__call__
    patches = [
        (door_module, "call_compiled", timed("user frame", call_compiled)),
        (Subgraph, "__call__", timed("subgraph", real_subgraph)),
        (Lowered, "forward", timed("lowered frame", real_forward)),
    ]
    for owner, name, wrapper in patches:
        setattr(owner, name, wrapper)
    for frame, frame_entries in zip(frames, entries):
        frame._entries = [
            (guards, timed("code", run), direct and timed("code", direct))
            for guards, run, direct in frame_entries
        ]
    user_entries = user._entries
    user._entries = _timed_guards(user_entries, spent, "user guards")
    samples = {label: [] for label in spent}
    try:
        door = timed("shared_call", call_door)
        loops = max(1, round(sample_s / max(_seconds(door), 1e-7)))
        for _ in range(rounds):
            for label in spent:
                spent[label] = 0.0
            for _ in range(loops):
                door()
            for label in spent:
                samples[label].append(spent[label] / loops * 1e6)
    finally:
        user._entries = user_entries
        door_module.call_compiled = call_compiled
        Subgraph.__call__ = real_subgraph
        Lowered.forward = real_forward
        for frame, frame_entries in zip(frames, entries):
            frame._entries = frame_entries
    medians = {label: statistics.median(v) for label, v in samples.items()}
    reads = _clock_read_us()  # the inner layer's two reads fall inside each outer layer's span
    own = {}
    for outer, inner in zip(_NESTED, _NESTED[1:]):
        own[outer] = medians[outer] - medians[inner] - 2 * reads
    own["code"] = medians["code"]
    own["user guards"] = medians["user guards"] - 2 * reads
    own["user frame"] -= 2 * reads  # the guards' timer reads fall inside the user's frame
    return {f"in call: {label}": value for label, value in own.items()}


def _clock_read_us() -> float:
    """Microseconds one read of the thread's CPU clock takes (a system call on some VMs)."""
    reads = 10_000
    start = time.thread_time()
    for _ in range(reads):
        time.thread_time()
    return (time.thread_time() - start) / (reads + 1) * 1e6


def _seconds(call) -> float:
    start = time.thread_time()
    call()
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="dlrm,glm_dcnv2,target_attention,history_transformer")
    parser.add_argument("--sizes", default="1x270,4x1024")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--sample-ms", type=float, default=100.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    doors.retain_freed_memory()  # as doors.py times: freed memory kept, no page faults per call
    print("| model | R x N | door, off us | door, as before us | door, on us | hand us "
          "| hand, tags us | cm us | hand / door | door / cm | frame + shared_call, hot / cold "
          "| subgraph, hot / cold | in the call: shared_call / user frame / subgraph / "
          "lowered frame / code us | guard check in the call: user's frame / hand's frame us |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        for size in args.sizes.split(","):
            requests, candidates = map(int, size.split("x"))
            t = measure(name, requests, candidates, args.rounds, args.sample_ms / 1e3)
            off, on, before = t["door, off"], t["door, on"], t["door, as before"]
            in_call = " / ".join(f"{t['in call: ' + label]:.0f}" for label in _NESTED)
            print(f"| {name} | {requests} x {candidates} | {off:.0f} | {before:.0f} | {on:.0f} "
                  f"| {t['hand']:.0f} | {t['hand, tags']:.0f} | {t['cm']:.0f} "
                  f"| {t['hand'] / on:.2f} | {on / t['cm']:.2f} "
                  f"| {t['frame hot']:.0f} / {t['frame cold']:.0f} "
                  f"| {t['sub hot']:.0f} / {t['sub cold']:.0f} "
                  f"| {in_call} | {t['in call: user guards']:.0f} / {t['hand guards']:.0f} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
