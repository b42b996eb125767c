"""Mislabelled request inputs: a declared request input that varies on (nearly) every row.

A drop-in call finds its requests as runs of consecutive rows equal in every request input
(:mod:`.request_detection`). A candidate feature declared request-side (``features.item_id``)
changes on every row, so every candidate becomes its own request: the call stays exact, but the
request-side work runs N times plus the cost of sharing, slower than the original model, and the
report (FLOPs from the graph) still claims a high request share.

The sign, from per-input groupings: the call is *degenerate* (at least ``MIN_ROWS`` rows, at
least ``VARYING_SHARE`` of them starting a request); some request inputs alone start a request
on at least ``VARYING_SHARE`` of the rows while the other request inputs, together, start one on
at most ``GROUPED_SHARE`` of them. Replicated request inputs are constant within a request, so
an input that varies where the others repeat is candidate-side, or the batch does not keep a
request's rows together; either way sharing cannot help, and the input is named.

The per-input scans run only on degenerate calls, and on at most ``MAX_CHECKS`` of them per
compiled model: a mislabel shows on the first one, and a model whose batches really have one
candidate per request should not pay the scans on every call.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..rows.request_detection import request_starts

__all__ = ["MislabelWatch", "add_note", "example_finding", "varying_inputs"]

MIN_ROWS = 8
VARYING_SHARE = 0.75
GROUPED_SHARE = 0.5
MAX_CHECKS = 4


def varying_inputs(
    leaves: Mapping[str, Any],
    request_inputs: Sequence[str],
    rows: int,
    num_requests: int | None = None,
) -> list[str]:
    """The request inputs that vary on (nearly) every row while the others group rows; [] when
    the grouping of all request inputs (``num_requests`` requests, counted when None) is not
    degenerate or no other input groups rows."""
    if rows < MIN_ROWS or len(request_inputs) < 2:
        return []
    tensors = {n: leaves[n] for n in request_inputs}
    if any(not isinstance(t, torch.Tensor) or t.dim() == 0 for t in tensors.values()):
        return []
    if num_requests is None:
        num_requests = len(request_starts(list(tensors.values()), rows))
    if num_requests < VARYING_SHARE * rows:
        return []
    varying = [
        n for n in request_inputs if len(request_starts([tensors[n]], rows)) >= VARYING_SHARE * rows
    ]
    grouping = [tensors[n] for n in request_inputs if n not in varying]
    if not varying or not grouping:
        return []
    return varying if len(request_starts(grouping, rows)) <= GROUPED_SHARE * rows else []


def _message(names: list[str], where: str) -> str:
    which = ", ".join(repr(n) for n in names)
    return (
        f"rocs: request input(s) {which} vary on (nearly) every row of {where} while the other "
        "request inputs repeat within requests: a candidate feature declared request-side? "
        "Every candidate then forms its own request and sharing saves nothing (drop-in calls "
        "run slower than the original model). Declare only request-side inputs in "
        "request_inputs (or keep each request's rows together)."
    )


def example_finding(contract: Any, example_args: tuple, example_kwargs: Mapping) -> str | None:
    """The warning for a replicated example batch of a compiled model's ``contract``, or None."""
    leaves = contract.leaves(tuple(example_args), dict(example_kwargs))
    request_inputs = contract.request_inputs
    first = leaves.get(request_inputs[0]) if request_inputs else None
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return None
    names = varying_inputs(leaves, request_inputs, first.shape[0])
    return _message(names, "the example batch") if names else None


class MislabelWatch:
    """Per compiled model: looks at degenerate drop-in groupings, warns once, keeps the finding
    for the report."""

    def __init__(self, request_inputs: Sequence[str]):
        self.request_inputs = list(request_inputs)
        self.finding: str | None = None
        self._checks = 0
        self._warned = False

    def observe(self, leaves: Mapping[str, Any], counts: Sequence[int], rows: int) -> None:
        """A drop-in call's grouping: ``counts`` rows per request out of ``rows``."""
        if self._warned or self._checks >= MAX_CHECKS:
            return
        if rows < MIN_ROWS or len(counts) < VARYING_SHARE * rows:
            return
        self._checks += 1
        names = varying_inputs(leaves, self.request_inputs, rows, len(counts))
        if names:
            self._warned = True
            where = f"a drop-in batch ({len(counts)} requests in {rows} rows)"
            self.finding = _message(names, where)
            warnings.warn(self.finding, stacklevel=4)

    def annotate(self, report: Any) -> Any:
        """``report`` with the finding added to its note."""
        return add_note(report, self.finding)


def add_note(report: Any, finding: str | None) -> Any:
    """``report`` (a :class:`~rocs_compiler.report.build.Report`) with ``finding`` in its note."""
    if finding and finding not in report.note:
        report.note = f"{report.note}\n{finding}" if report.note else finding
    return report
