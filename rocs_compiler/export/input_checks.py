"""The checks a compiled model makes of a shared-layout call, as ops inside an exported program.

A compiled model refuses, before any compute, a ``candidate_to_request`` out of ``[0, R)`` and
request inputs with one row per candidate (R = N > 1) whose index is not a permutation (replicated
request rows passed with an index: read as requests, they would give wrong scores silently).
An exported program runs in runtimes that never see that Python code (``torch.export.load``,
AOTInductor's C++ loader), so the same conditions are traced into the graph as
``aten._assert_async`` nodes, which export keeps and AOTInductor compiles into a check that
raises the message. ONNX has no assert (its exporter drops them), so the same conditions also
guard the index by data flow: the checked index is ``index + zeros(1)[failed]``, a gather that
is out of bounds exactly when a check fails, which every runtime refuses (ONNX Runtime's Gather
names the node; :func:`~rocs_compiler.export.onnx.to_onnx` names that node after the checks).
The conditions are tensor ops of sizes, never Python comparisons of the symbolic sizes R and N
(those would specialize the program to R != N or R == N). The same holds for the check
``F.batch_norm`` makes in the original model, before a batch norm with batch statistics
(``runtime/program/eager_checks.py``): the exporter traces it before that op (``checking`` in
``export/__init__.py``), with its own guard of the op's input.

Identities: with ``counts = bincount(idx, minlength=R)``, and every value in range, ``idx`` is a
permutation of ``[0, N)`` exactly when R = N and no request row has count 0 (the counts sum to N;
``(counts > 0).all()``, true of the empty batch, R = N = 0, which eager answers with no scores);
where R != N the check passes without counting (a ``torch.cond`` on R == N).
A KeyedJaggedTensor key's padded piece ``ids [B, W]`` holds row b's ids in its first
``lengths[b]`` columns, so ``0 <= lengths[b] <= W`` is what makes ``lengths`` describe ``ids``.

Dtypes and the equality of candidate rows with the index's length are properties of the program's
signature, which a traced op cannot test (the graph is typed, and both lengths are the one size
N): a program loaded by ``rocs.load`` checks the index's dtype and length before its graph runs
(:func:`check_loaded_index`, the compiled model's own messages); an AOTInductor package checks
them by its own input checks (``aoti_checks.py``), on unless the serving process sets
``AOTI_RUNTIME_CHECK_INPUTS=0``.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from ..errors import InputError
from ..kernels.index_contract import check_candidate_to_request
from ..runtime.program.eager_checks import more_than_one_value_per_channel
from ..ir.graph_meta import INDEX_NAME

PREFIX = "rocs: "  # every message starts with it, so a caller can tell them from other failures

RANGE_MESSAGE = (
    f"{PREFIX}{INDEX_NAME} values must lie in [0, R) (R = rows of the request inputs, one per "
    "request)"
)
REPLICATED_MESSAGE = (
    f"{PREFIX}request inputs have one row per candidate, but {INDEX_NAME} groups candidates into "
    "fewer requests: the shared layout takes one row per request (pass each request's row once)"
)
VALUES_PER_CHANNEL_MESSAGE = (
    f"{PREFIX}Expected more than 1 value per channel when training: a batch norm normalizes by "
    "the statistics of the call's rows, and this call has one value per channel"
)
CAP_MESSAGE = (
    f"{PREFIX}input {{name!r}} is longer at dim {{dim}} than the model takes: at most {{cap}} (the "
    "model caps that size, slicing a table of fixed rows to it, a positional table say)"
)
LENGTHS_MESSAGE = (
    f"{PREFIX}KeyedJaggedTensor piece {{name}}: lengths must lie in [0, W] (W = columns of its "
    "ids); a row claims more ids than it has, or a negative number"
)


def check_shared_call(
    leaves: Mapping[str, torch.Tensor],
    index: torch.Tensor,
    request_rows_from: Optional[str],
    jagged: Sequence[str],
    caps: Sequence[tuple[str, int, int]] = (),
) -> torch.Tensor:
    """Trace the shared-layout checks of one call into the current graph; return the index
    guarded by them (equal to ``index`` whenever they pass).

    ``request_rows_from`` names a batched request leaf (its rows are R; None: the model has no
    request input, and R is N); ``jagged`` names the padded KJT pieces (``X`` for the leaves
    ``X.ids`` and ``X.lengths``); ``caps``: ``(leaf, dim, cap)`` for each dynamic size the graph
    caps (a history length past a positional table's rows), checked as a count of ones, a
    tensor op of the size (export's range of the size's symbol is lost in ONNX).
    """
    rows_from = index if request_rows_from is None else leaves[request_rows_from]
    num_requests = rows_from.shape[0]
    in_range = ((index >= 0) & (index < num_requests)).all()
    torch._assert_async(in_range, RANGE_MESSAGE)
    passed = in_range
    if request_rows_from is not None:
        # Only a call with as many request rows as candidates can be replicated rows: the count
        # of each request's candidates (a scatter over N, 2-5% of a small call in AOTInductor)
        # and of the candidates run in that case alone, the branch of a ``torch.cond`` on R == N
        # (a symbolic test in the graph, which no Python comparison specializes), where N rows
        # stand for the R requests: no operand carries R (in ONNX, each op of a check outside
        # the branch is a node every call runs).
        grouped = torch.cond(num_requests == index.shape[0], _grouped, _no_count, (index,))
        torch._assert_async(grouped, REPLICATED_MESSAGE)
        passed = passed & grouped
    for name in jagged:
        ids, lengths = leaves[f"{name}.ids"], leaves[f"{name}.lengths"]
        fits = ((lengths >= 0) & (lengths <= ids.shape[1])).all()
        torch._assert_async(fits, LENGTHS_MESSAGE.format(name=name))
        passed = passed & fits
    for name, dim, cap in caps:
        size = torch.ones(leaves[name].shape[dim], dtype=torch.int64, device=index.device).sum()
        fits = size <= cap
        torch._assert_async(fits, CAP_MESSAGE.format(name=name, dim=dim, cap=cap))
        passed = passed & fits
    return index + _zero_unless_failed(passed, torch.int64, index.device)


def _grouped(index: torch.Tensor) -> torch.Tensor:
    """With R = N: True when every request row has a candidate (``all`` rather than
    ``min() > 0``: an empty batch, R = N = 0, passes, as in eager), or there is at most one
    candidate."""
    candidate_ones = torch.ones_like(index)
    safe = index.clamp(0, index.shape[0] - 1)
    counts = torch.zeros_like(index).index_add(0, safe, candidate_ones)
    return (counts > 0).all() | (candidate_ones.sum() <= 1)


def _no_count(index: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=torch.bool, device=index.device)


def check_loaded_index(index: object, candidate_rows: Optional[torch.Tensor]) -> None:
    """Before a loaded program's graph runs: ``index`` is an int64 ``[N]`` tensor with one entry
    per row of ``candidate_rows`` (a candidate input; None for a model without one), else the
    compiled model's :class:`InputError` naming the dtype or the lengths. The range is checked in
    the graph."""
    rows = candidate_rows.shape[0] if isinstance(candidate_rows, torch.Tensor) else None
    check_candidate_to_request(index, rows, None, check_range=False)


def check_values_per_channel(value: torch.Tensor) -> torch.Tensor:
    """Trace ``F.batch_norm``'s check of a batch norm's input with batch statistics (more than
    one value per channel: rows times spatial extent, ``runtime/program/eager_checks.py``) into the
    current graph; return ``value`` guarded by it (equal to ``value`` whenever it passes: times a
    one gathered from ``[1]`` at 0, out of bounds when it fails, for runtimes without asserts).
    The guard's gather reads an int32 zero, which tells it from the index's (``onnx.py``)."""
    values = torch.ones_like(value.select(1, 0)).sum()
    passed = values != 1
    torch._assert_async(passed, VALUES_PER_CHANNEL_MESSAGE)
    return value * (_zero_unless_failed(passed, torch.int32, value.device) + 1).to(value.dtype)


# Each traced check by the runtime's check of the same node (``runtime/program/eager_checks.py``).
TRACED_EAGER_CHECKS = {more_than_one_value_per_channel: check_values_per_channel}


def _zero_unless_failed(passed: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """``[0]`` of ``dtype``, gathered from ``zeros(1)`` at 0 when ``passed``, else at 1: out of
    bounds, which every runtime refuses (the data-flow form of a check, for ONNX)."""
    failed = (~passed).to(torch.int64).reshape(1)
    return torch.zeros(1, dtype=dtype, device=device).index_select(0, failed)


def jagged_pieces(names: Sequence[str]) -> list[str]:
    """The padded KJT pieces among a program's leaf names: ``X`` where ``X.ids`` and
    ``X.lengths`` are both leaves."""
    present = set(names)
    return [n[: -len(".lengths")] for n in names
            if n.endswith(".lengths") and n[: -len(".lengths")] + ".ids" in present]  # fmt: skip


def as_input_error(err: RuntimeError) -> Optional[InputError]:
    """The :class:`InputError` for a failed in-graph check (its message after :data:`PREFIX`),
    or None for any other error."""
    message = str(err)
    at = message.find(PREFIX)
    if at < 0:
        return None
    return InputError(message[at + len(PREFIX):].splitlines()[0])
