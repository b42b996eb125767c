"""Jagged calls: a call whose histories are padded past most requests' lengths runs as a few
calls, requests grouped by length and each group's histories cut to its longest; histories given
as jagged nested tensors are padded first (``nested_histories.py``).

Identity (``analysis/truncation.py``): the truncation proof shows that every output row is the
same for a history padded to the call's width and cut to any width at or past its own request's
length, and that no output row reads another; so a group's call (its requests, at its width, and
their candidates) returns these candidates' rows of the whole call, and the rows of all groups,
put back in the candidates' order, are the call's outputs. In the drop-in layout each row is its
own request.

A request's length is read from the call (``LengthSource``): one past its last id other than the
padding id, or the lengths input itself (refused when negative or past the histories' width).
How requests are grouped: ``jagged_groups.py``. A call that stays one group at its own width runs
as it is; so does a call under tracing, a call under autograd of an inference compile, and every
call of a model whose proof failed (its nested histories padded to the longest first). A training
compile's calls split under autograd too: each group's call backpropagates into the model's
parameters, and the gradient of the whole call is the sum of the groups'.
"""

from __future__ import annotations

import inspect
import threading
from types import SimpleNamespace

import torch
from torch.utils import _pytree as pytree

from ...analysis.truncation import (
    LengthSource,
    Truncation,
    history_inputs,
    prove_truncations,
)
from ...errors import InputError
from ...formats.leaves import named_leaves, replace_leaves
from . import jagged_groups
from .jagged_groups import UnitCosts, plan_groups, unit_costs
from .nested_histories import is_nested, padded_histories

NOT_SPLIT = object()


class JaggedCalls:
    """A compiled model's jagged calls (``cm._jagged``): the histories (``cut``: ``{input:
    dims}``), the truncation proof (None: calls keep their width) and the unit costs the grouping
    weighs."""

    def __init__(self, contract, cut: dict, truncation: Truncation | None, costs: UnitCosts | None):
        self.signature: inspect.Signature = contract.signature
        self.request_names = frozenset(contract.request_inputs)
        self.batched_names = frozenset(contract.batched_inputs)
        self.cut = dict(cut)
        self.truncation = truncation
        self.source = truncation.source if truncation is not None else None
        self.costs = costs
        source = self.source
        pad = source.pad if source is not None and source.pad is not None else 0
        self.pads = {name: pad for name in self.cut}
        self.lengths_input = source.input if source is not None and source.pad is None else None
        self.converted = False  # a converting format's calls: cut once converted (``path.py``)
        self._inside = threading.local()
        self.split_calls = 0  # calls run as groups (for reports and tests)

    def applies(self) -> bool:
        """Not a group's own call."""
        return not getattr(self._inside, "active", False)

    def run(self, cm, args: tuple, kwargs: dict, index):
        """The call as groups (each through ``cm.forward``, the call path), the call with its
        nested histories padded, or :data:`NOT_SPLIT`."""
        if self.converted:
            return NOT_SPLIT  # cut in the program's terms (:meth:`run_converted`)
        try:
            bound = self.signature.bind(*args, **kwargs).arguments
        except TypeError:
            return NOT_SPLIT  # the call path names the mistake
        flat = all(isinstance(v, torch.Tensor) for v in bound.values())
        if flat:
            leaves = dict(bound)
        else:
            leaves = named_leaves(bound)

        def call(inputs: dict, group_index):
            if flat:
                group_args, group_kwargs = (), inputs
            else:
                group_args, group_kwargs = replace_leaves(self.signature, args, kwargs, inputs)
            if group_index is None:
                return cm.forward(*group_args, **group_kwargs)
            return cm.forward(*group_args, **group_kwargs, candidate_to_request=group_index)

        nested = [name for name in self.cut if is_nested(leaves.get(name))]
        if nested:
            leaves = self.padded(leaves)
        cm._input_specs.check_caps(leaves)  # the call's width, before any group is cut below it
        if self.truncation is not None and _may_split(cm):
            result = self.split(call, leaves, index)
            if result is not NOT_SPLIT:
                return result
        if not nested:
            return NOT_SPLIT
        self._inside.active = True
        try:
            return call(leaves, index)
        finally:
            self._inside.active = False

    def cuts(self, cm) -> bool:
        """Whether this call may be cut: a proof, outside tracing (:func:`_may_split`), and not
        a group's own call."""
        return self.truncation is not None and self.applies() and _may_split(cm)

    def run_converted(self, cm, leaves: dict, index, call):
        """A converted call (``formats/``: its leaves, in the program's terms, which
        :meth:`cuts`) as groups, each run by ``call(inputs, index)``, or :data:`NOT_SPLIT`."""
        cm._input_specs.check_caps(leaves)
        return self.split(call, leaves, index)

    def padded(self, bound: dict) -> dict:
        """``bound`` with its histories given as jagged nested tensors padded (refused when some
        are nested and some are not)."""
        nested = [name for name in self.cut if is_nested(bound.get(name))]
        if not nested:
            return bound
        if len(nested) < len(self.cut):
            dense = sorted(set(self.cut) - set(nested))
            raise InputError(
                f"histories {nested} are nested tensors and {dense} are not: give all of them "
                "one way"
            )
        return padded_histories(bound, nested, self.pads, self.lengths_input)

    def split(self, call, bound: dict, index):
        """The call (``bound``: its tensors by leaf name; ``index``: None in the drop-in layout)
        run as groups, each by ``call(inputs, index)`` with this object's own cut skipped, or
        :data:`NOT_SPLIT` when it stays one group at its width."""
        source = bound.get(self.source.input)
        if not isinstance(source, torch.Tensor):
            return NOT_SPLIT
        width = self._width(bound)
        if width is None or width <= 1:
            return NOT_SPLIT
        if self.source.pad is not None and not self._may_pay(source, index, width):
            return NOT_SPLIT  # (lengths given as an input are read first: they are checked there)
        lengths = self.lengths(source, width)
        rows = lengths.shape[0]
        if not rows or int(lengths.min()) > (1 << (width - 1).bit_length()) // 2:
            return NOT_SPLIT  # every request's power-of-two width is the call's: nothing to cut
        if index is None:
            counts = torch.ones_like(lengths)
        else:
            if not isinstance(index, torch.Tensor) or index.dim() != 1:
                return NOT_SPLIT  # the call path checks and refuses
            if index.dtype != torch.int64 or not index.numel() or int(index.min()) < 0:
                return NOT_SPLIT
            counts = torch.bincount(index, minlength=rows)
            if counts.shape[0] != rows:
                return NOT_SPLIT  # an index out of range: the call path refuses it
        needs_content = bool(self.truncation.needs_content)
        groups = plan_groups(lengths, counts, width, self.costs, needs_content)
        if len(groups) == 1 and groups[0][1] == width:
            return NOT_SPLIT
        self.split_calls += 1
        return self._run_groups(call, bound, index, groups, rows)

    def _may_pay(self, source: torch.Tensor, index, width: int) -> bool:
        """Whether cutting every history of the call to length one would save a call's cost:
        if not, no grouping does, and the lengths are not read (a small call stays fast)."""
        requests = source.shape[0]
        candidates = index.shape[0] if isinstance(index, torch.Tensor) and index.dim() else requests
        (_, request_slope), (_, candidate_slope) = self.costs.request, self.costs.candidate
        saved = (requests * request_slope + candidates * candidate_slope) * (width - 1)
        return saved > jagged_groups.CALL_FLOPS

    def lengths(self, source: torch.Tensor, width: int) -> torch.Tensor:
        """Each request's length (int64 ``[R]``), read from ``source``."""
        name = self.source.input
        if self.source.pad is None:
            lengths = source.to(torch.int64)
            if lengths.numel():
                low, high = int(lengths.min()), int(lengths.max())
                if low < 0:
                    row = int((lengths < 0).nonzero()[0])
                    raise InputError(f"input {name!r} holds a negative length ({low}) at row {row}")
                if high > width:
                    row = int((lengths > width).nonzero()[0])
                    raise InputError(
                        f"input {name!r} holds length {high} at row {row}, past the histories' "
                        f"width {width} ({', '.join(map(repr, self.cut))})"
                    )
            return lengths
        content = source.movedim(self.source.dim, -1) != self.source.pad
        content = content.reshape(content.shape[0], -1, content.shape[-1]).any(1)
        positions = torch.arange(1, content.shape[-1] + 1, device=source.device)
        return (content * positions).amax(1) if content.shape[-1] else content.sum(1)

    def _width(self, bound: dict) -> int | None:
        widths = set()
        for name, dims in self.cut.items():
            value = bound.get(name)
            if not isinstance(value, torch.Tensor) or value.dim() <= max(dims):
                return None
            widths.update(value.shape[d] for d in dims)
        return widths.pop() if len(widths) == 1 else None  # disagreeing widths: the path refuses

    def _run_groups(self, call, bound: dict, index, groups, num_requests: int):
        device = self._device(bound) if index is None else index.device
        group_of_request = torch.empty(num_requests, dtype=torch.int64, device=device)
        for g, (requests, _) in enumerate(groups):
            group_of_request[requests] = g
        group_of_candidate = group_of_request if index is None else group_of_request[index]
        parts, rows, spec = [], [], None
        self._inside.active = True
        try:
            for g, (requests, width) in enumerate(groups):
                candidates = (group_of_candidate == g).nonzero().squeeze(1)
                if not candidates.numel():
                    continue  # requests without candidates return no rows
                sub = self._group_inputs(bound, requests, candidates, width, index is None)
                if index is None:
                    out = call(sub, None)
                else:
                    remap = torch.full_like(group_of_request, -1)
                    remap[requests] = torch.arange(requests.shape[0], device=device)
                    out = call(sub, remap[index[candidates]])
                flat, spec = pytree.tree_flatten(out)
                parts.append(flat)
                rows.append(candidates)
        finally:
            self._inside.active = False
        # The groups' rows in the call's order: one gather of their concatenation (autograd
        # flows through it to each group's call).
        order = torch.argsort(torch.cat(rows))
        leaves = [torch.cat(column).index_select(0, order) for column in zip(*parts)]
        return pytree.tree_unflatten(leaves, spec)

    def _device(self, bound: dict) -> torch.device:
        return next(v.device for v in bound.values() if isinstance(v, torch.Tensor))

    def _group_inputs(self, bound, requests, candidates, width: int, dropin: bool) -> dict:
        """The group's call: its requests' rows cut to ``width``, its candidates' rows."""
        sub = {}
        for name, value in bound.items():
            if name in self.cut:
                for d in self.cut[name]:
                    value = value.narrow(d, 0, width)
                sub[name] = value.index_select(0, requests)
            elif not isinstance(value, torch.Tensor) or not value.dim():
                sub[name] = value
            elif name in self.request_names or (dropin and name in self.batched_names):
                sub[name] = value.index_select(0, requests)
            elif name in self.batched_names:
                sub[name] = value.index_select(0, candidates)
            else:
                sub[name] = value
        return sub


def plan_of(jagged: JaggedCalls | None, caps=()) -> dict | None:
    """What a caller of an exported program needs to cut its calls as the compiled model's
    (JSON; ``caps``: ``InputSpecs.caps``, a call's width checked before it is cut): None when
    the compiled model's calls keep their width."""
    if jagged is None or jagged.truncation is None or jagged.converted:
        return None  # (a converting format's program takes its pieces, which calls do not cut)
    source = jagged.source
    return {
        "arguments": [p for p in jagged.signature.parameters if p != "self"],
        "request_inputs": sorted(jagged.request_names),
        "batched_inputs": sorted(jagged.batched_names),
        "histories": {name: list(dims) for name, dims in jagged.cut.items()},
        "source": {"input": source.input, "dim": source.dim, "pad": source.pad},
        "needs_content": list(jagged.truncation.needs_content),
        "costs": {"request": list(jagged.costs.request), "candidate": list(jagged.costs.candidate)},
        "caps": [list(cap) for cap in caps],
    }


def from_plan(plan: dict) -> JaggedCalls:
    """The jagged calls a :func:`plan_of` describes, for a program's caller."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    contract = SimpleNamespace(
        signature=inspect.Signature([inspect.Parameter(a, kind) for a in plan["arguments"]]),
        request_inputs=tuple(plan["request_inputs"]),
        batched_inputs=tuple(plan["batched_inputs"]),
    )
    source = plan["source"]
    truncation = Truncation(
        LengthSource(source["input"], int(source["dim"]), source["pad"]),
        {name: tuple(dims) for name, dims in plan["histories"].items()},
        tuple(plan["needs_content"]),
    )
    costs = UnitCosts(tuple(plan["costs"]["request"]), tuple(plan["costs"]["candidate"]))
    return JaggedCalls(contract, truncation.inputs, truncation, costs)


def _may_split(cm) -> bool:
    """Outside tracing; under autograd only for a training compile (whose calls backpropagate
    into the model's parameters through each group's call)."""
    if torch.compiler.is_compiling():
        return False
    return not torch.is_grad_enabled() or cm._training is not None


def jagged_calls(result, contract) -> tuple[JaggedCalls | None, str | None]:
    """A compiled model's jagged calls and why its calls keep their width (None: they may be
    cut, or the model has no history length, and then no jagged calls either). Of several
    lengths that may be cut (a KeyedJaggedTensor's keys), the calls cut the one whose length the
    model's FLOPs grow with most."""
    captured = result.captured
    cut = history_inputs(captured.graph_module, captured.placeholder_of, captured.batch_symbol)
    if not cut:
        return None, None
    proofs, refusal = prove_truncations(
        captured.graph_module, captured.placeholder_of, contract.request_inputs,
        captured.batch_symbol,
    )  # fmt: skip
    if not proofs:
        return JaggedCalls(contract, cut, None, None), refusal.reason
    sizes = result.length_sizes()

    def costs_of(proof: Truncation) -> UnitCosts:
        name = next(iter(proof.inputs))
        return unit_costs(result, name, int(sizes[name].node.hint))

    costs, proof = max(
        ((costs_of(p), p) for p in proofs), key=lambda cp: cp[0].request[1] + cp[0].candidate[1]
    )
    return JaggedCalls(contract, proof.inputs, proof, costs), None


def jagged_summary(jagged: JaggedCalls | None, refused: str | None) -> str:
    """The report's line on jagged calls ("" for a model without a history length)."""
    if jagged is not None and jagged.truncation is not None:
        return f"on: each request's history cut to its length, read from {jagged.source.describe()}"
    return f"off: {refused}" if refused else ""
