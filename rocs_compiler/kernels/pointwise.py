"""Elementwise chains over candidate and request tensors: ``rocs::broadcast_pointwise``.

Axis letters: R requests, N candidates; S is the trailing shape shared by all inputs.

``broadcast_pointwise(program: str, candidate_inputs: [N, *S] list, request_inputs: [R, *S]
list, idx [N]) -> [N, *S]`` evaluates ``program`` (see ``pointwise_program.py``) where
``c<i>`` is ``candidate_inputs[i]`` and ``r<i>`` is ``request_inputs[i][idx]``. All inputs
share one dtype and the trailing shape S; callers expand beforehand (expanded inputs are
made contiguous, which copies them).

CPU path: torch ops in the inputs' dtype (the eager chain's own kernels), over chunks of
candidates of about ``CHUNK_BYTES`` per tensor; request rows are gathered per chunk, so
the full ``[N, *S]`` request gather never exists, and temporaries live in a few reused
chunk buffers (peak memory: the output plus a few chunks). CUDA path: a kernel generated from the
program (``pointwise_triton.py``), math in float32. FLOPs: one per op application per
output element (torch's own counter does not count elementwise ops; these do, so that
fused chains are visible in reports).
"""

from __future__ import annotations

import math

import torch

from rocs_compiler.kernels.pointwise_program import (
    PRIMITIVES,
    Call,
    Const,
    Input,
    Node,
    as_program,
    as_tensor_arg,
    check_program,
    distinct_subexpressions,
    evaluate,
    num_ops,
    parse_program,
)
from rocs_compiler.kernels.rocs_op import RocsOp, define

# Size of one chunk of each input or temporary on the CPU path: small enough that a chain's
# live values stay in cache, large enough that per-chunk Python overhead does not show.
CHUNK_BYTES = 1 << 20


def _check(program, candidate_inputs, request_inputs, candidate_to_request):
    check_program(program, len(candidate_inputs), len(request_inputs))
    tensors = list(candidate_inputs) + list(request_inputs)
    first = tensors[0]
    trailing = tuple(first.shape[1:])
    for name, group in (("c", candidate_inputs), ("r", request_inputs)):
        for i, t in enumerate(group):
            if t.dtype != first.dtype or tuple(t.shape[1:]) != trailing:
                raise ValueError(
                    f"rocs::broadcast_pointwise: {name}{i} is {t.dtype} {list(t.shape)}, "
                    f"expected {first.dtype} [*, {', '.join(map(str, trailing))}]"
                )
            if t.device != candidate_to_request.device:
                raise ValueError(f"rocs::broadcast_pointwise: {name}{i} is on {t.device}")
    for i, t in enumerate(candidate_inputs):
        if t.shape[0] != candidate_to_request.shape[0]:
            raise ValueError(f"rocs::broadcast_pointwise: c{i} has {t.shape[0]} rows, expected N")
    if any(t.shape[0] != request_inputs[0].shape[0] for t in request_inputs):
        raise ValueError("rocs::broadcast_pointwise: request inputs have different row counts")
    # Without request inputs nothing is read through the index: only its dtype and length matter.
    return None, (request_inputs[0].shape[0] if request_inputs else None)


def _cpu(program, candidate_inputs, request_inputs, candidate_to_request) -> torch.Tensor:
    node = as_program(program)
    first = candidate_inputs[0] if candidate_inputs else request_inputs[0]
    trailing = tuple(first.shape[1:])
    num_candidates = candidate_to_request.shape[0]
    out = first.new_empty((num_candidates, *trailing))
    if out.numel() == 0:
        return out
    rows = max(1, CHUNK_BYTES // max(1, math.prod(trailing) * first.element_size()))
    chunk_eval = _ChunkEvaluator(node, (min(rows, num_candidates), *trailing), first)
    for start in range(0, num_candidates, rows):
        chunk = slice(start, start + rows)
        chunk_eval(candidate_inputs, request_inputs, candidate_to_request[chunk], chunk, out[chunk])
    return out


class _ChunkEvaluator:
    """Evaluates a program on one chunk of candidates at a time, writing into ``out``.

    Request rows are gathered with ``index_select(..., out=buffer)``, every op writes into
    a scratch buffer with ``out=`` and the last op writes straight into the output. Buffers
    return to a free list after their last use and serve the next ops and chunks, so after
    the first chunk nothing is allocated: a chain runs in a few cache-sized buffers instead
    of allocating (and page-faulting) one fresh ``[N, *S]`` tensor per op.
    """

    def __init__(self, node: Node, chunk_shape: tuple, like: torch.Tensor):
        self.node = node
        self.order = list(distinct_subexpressions(node))
        self.uses: dict[str, int] = {}
        for n in self.order:
            if isinstance(n, Call):
                for arg in n.args:
                    self.uses[str(arg)] = self.uses.get(str(arg), 0) + 1
        self.chunk_shape, self.like = chunk_shape, like
        self.free: list[torch.Tensor] = []

    def _take(self) -> torch.Tensor:
        if self.free:
            return self.free.pop()
        return torch.empty(self.chunk_shape, dtype=self.like.dtype, device=self.like.device)

    def __call__(self, candidate_inputs, request_inputs, idx_chunk, chunk, out_chunk):
        rows = out_chunk.shape[0]
        uses = dict(self.uses)
        values: dict[str, object] = {}
        owned: dict[str, torch.Tensor] = {}  # key -> scratch buffer holding its value
        root = str(self.node)
        for n in self.order:
            key = str(n)
            if isinstance(n, Input) and n.kind == "c":
                values[key] = candidate_inputs[n.index][chunk]
            elif isinstance(n, Input):
                owned[key] = self._take()
                values[key] = torch.index_select(
                    request_inputs[n.index], 0, idx_chunk, out=owned[key][:rows]
                )
            elif isinstance(n, Const):
                values[key] = n.value
            else:
                args = [values[str(a)] for a in n.args]
                # Free arguments whose last use this is before picking the destination: an
                # elementwise op may write over an input it reads exactly (same buffer).
                for arg in n.args:
                    arg_key = str(arg)
                    uses[arg_key] -= 1
                    if uses[arg_key] == 0 and arg_key in owned:
                        self.free.append(owned.pop(arg_key))
                prim = PRIMITIVES[n.op]
                if not any(isinstance(a, torch.Tensor) and a.dim() > 0 for a in args):
                    # Literal-only subexpression: a 0-dim value, broadcast where it is used.
                    values[key] = prim.torch_fn(*[as_tensor_arg(a, self.like) for a in args])
                    continue
                if key == root:
                    dest = out_chunk
                else:
                    owned[key] = self._take()
                    dest = owned[key][:rows]
                prim.torch_out(*[as_tensor_arg(a, self.like) for a in args], out=dest)
                values[key] = dest
        if values[root] is not out_chunk:
            out_chunk.copy_(torch.as_tensor(values[root], dtype=out_chunk.dtype))
        self.free.extend(owned.values())


def _fake(program, candidate_inputs, request_inputs, candidate_to_request):
    check_program(program, len(candidate_inputs), len(request_inputs))
    first = (list(candidate_inputs) + list(request_inputs))[0]
    for t in candidate_inputs:
        torch._check(t.shape[0] == candidate_to_request.shape[0])
    return first.new_empty((candidate_to_request.shape[0], *first.shape[1:]))


def _flops(program, candidate_shapes, request_shapes, idx_shape, **kwargs):
    first = (list(candidate_shapes) + list(request_shapes))[0]
    return num_ops(program) * idx_shape[0] * math.prod(first[1:])


def _reference(program, candidate_inputs, request_inputs, candidate_to_request):
    env = {f"c{i}": t for i, t in enumerate(candidate_inputs)}
    env.update(
        {f"r{i}": t.index_select(0, candidate_to_request) for i, t in enumerate(request_inputs)}
    )
    first = (list(candidate_inputs) + list(request_inputs))[0]
    result = evaluate(parse_program(program), env, like=first)
    shape = (candidate_to_request.shape[0], *first.shape[1:])
    fresh = isinstance(result, torch.Tensor) and all(result is not t for t in env.values())
    if fresh and result.shape == shape and result.dtype == first.dtype:
        return result
    # Constant programs, or a program that is just one input: broadcast / copy.
    return torch.as_tensor(result, dtype=first.dtype, device=first.device).expand(shape).clone()


BROADCAST_POINTWISE = define(
    RocsOp(
        name="broadcast_pointwise",
        check=_check,
        fake=_fake,
        flops=_flops,
        cpu=_cpu,
        triton="pointwise_triton:broadcast_pointwise",
        reference=_reference,
        index_arg=3,
        dispatch=lambda program, cands, reqs, index: (list(cands) + list(reqs))[0],
    )
)
