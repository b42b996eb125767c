"""The captured graph itself, run on replicated inputs: the program for calls where sharing
does not pay.

A compiled model's shared program saves the request side's repeated work but adds work of its
own: finding the requests of a drop-in call, gathering request rows to the candidates, the
joins of request and candidate parts that defer and share introduce. At a few candidates per
request, or for a model with little request-side work, that can cost more than it saves.
The plain program runs the model's own ops (the functional ATen graph of its forward, cleaned
up as the shared graph is) through a direct program: each op called once per candidate, as
eager calls it, without eager's module and Python overhead.

Identity: the captured graph on replicated inputs computes the original model's forward op
for op; in the shared layout the replicated inputs are ``request_input[candidate_to_request]``.
It follows the model's weights as the shared graph does (its own :class:`WeightRefresh`).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch
from torch import fx, nn

from ...ir.graph_meta import PLACEMENT
from ...ir.roles import Role
from ..program.direct import direct_program
from .input_checks import InputSpecs
from ..follow.weights import WeightRefresh


class PlainProgram:
    """``gm`` (the cleaned captured graph) as a program over the model's inputs, in order
    (``input_names``; None: the compiled program's, ``InputContract.input_names``)."""

    def __init__(
        self,
        gm: fx.GraphModule,
        original: nn.Module,
        weight_names: Mapping[str, str],
        input_names: Optional[Sequence[str]] = None,
        batched: Optional[Mapping[str, bool]] = None,
    ):
        self.graph_module = gm
        self.input_names = None if input_names is None else list(input_names)
        # A call run as called (``settled_plain.run_settled_as_called``) is checked by these: the
        # program's inputs by name (an input not in ``batched``, a packed one, is batched).
        names, batched = self.input_names or [], batched or {}
        self.name_set = frozenset(names)
        self.batched_names = [n for n in names if batched.get(n, True)]
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self.input_specs = InputSpecs.of_graph(
            gm, dict(zip(names, placeholders)), {n: batched.get(n, True) for n in names}
        )
        self._weights = WeightRefresh(gm, original, weight_names) if weight_names else None
        self._runner: Optional[Callable] = None
        self._runner_epoch = -1
        self._constant_outputs = constant_output_positions(gm)

    def __call__(self, inputs: list) -> list:
        outputs = self._program()(*inputs)
        if self._constant_outputs:
            outputs = list(outputs)
            for i in self._constant_outputs:
                outputs[i] = outputs[i].clone()  # never hand out the program's own buffers
        return outputs

    def moved(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """After the compiled model's ``_apply(fn)``: move the graph's tensors the same way."""
        self.graph_module._apply(fn)
        self._runner = None
        self.input_specs = self.input_specs.moved(fn)
        if self._weights is not None:
            self._weights.bind()

    def follow(self, model: nn.Module) -> None:
        """Follow ``model``'s weights instead, by the same names (``WeightRefresh.following``)."""
        if self._weights is not None:
            self._weights = self._weights.following(model)
        self._runner = None

    def _program(self) -> Callable:
        weights, epoch = self._weights, 0
        if weights is not None:
            if not weights.current():
                weights.refresh()
            epoch = weights.epoch
        if self._runner is None or self._runner_epoch != epoch:
            self._runner = direct_program(self.graph_module)
            self._runner_epoch = epoch
        return self._runner


def constant_output_positions(gm: Optional[fx.GraphModule]) -> list[int]:
    """Positions of ``gm``'s tensor outputs placed CONST (a weight, a folded constant): a
    program must hand out copies of them, never its own buffers."""
    if gm is None:
        return []
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return [
        i
        for i, r in enumerate(output.args[0])
        if isinstance(r, fx.Node)
        and r.meta.get(PLACEMENT) == Role.CONST
        and isinstance(r.meta.get("val"), torch.Tensor)
    ]
