"""The training program: the shared graph run under autograd on the model's own parameters.

A training compile (``rocs.compile(..., training=True)``) folds no weights (``cleanup(fold=False)``),
so every value of the shared graph is computed at each call from the weights and the inputs. The
graph's weights are aliases made at capture (detached); this program instead reads each
parameter and buffer of the model *itself* (the same ``nn.Parameter`` objects, no copies): every
``get_attr`` of a model weight becomes a leading input of the program, bound per call to the
tensor the model holds under that name. So ``loss.backward()`` accumulates into ``p.grad`` of the
original parameters, any optimizer over ``model.parameters()`` works, and the next call reads the
updated values (and follows a reassigned parameter: names are looked up again whenever a module
registration happened anywhere, ``weights.registrations()``).

Identity: every node of the shared graph equals the original graph's node gathered by
``candidate_to_request`` (REQUEST) or equals it outright (CANDIDATE, CONST) (``passes/share.py``),
for all weights; the backward of a gather is a per-request sum (``index_add``), and every
``rocs::`` op's backward is that of its reference (``kernels/rocs_op.py``). So each parameter's
gradient equals eager's on the replicated batch, up to re-association of its sums (the same
bounds as the forward, docs/contract.md). The graph runs as a direct program
(``runtime/program/direct.py``) whose fused ops are autograd nodes of that same backward
(``RocsOp.run_with_backward``), the call checked by the runtime before it runs. An embedding
table read by several lookups is read by one node whose backward fills one gradient buffer for
them all (``table_gradients.py``).

With ``Options.request_dropout == "per_request"`` a dropout on request rows draws one mask per
request (:func:`draws_per_request`): the program then computes another model than the original
(eager draws per impression), so it runs without the choice below.

A forward that writes buffers (batch norm in training mode updating its running statistics)
is captured functionalized: the new values are extra graph outputs, which this program copies
into the model's buffers after each call, as eager's forward does. The batch statistics mix rows,
so the batch norm runs per impression (its rule is not row-wise), on the replicated rows eager
normalizes: the statistics, the output and the update equal eager's.

Functionalization writes a slice assignment (``h[:, 0] = x``) as ``aten.copy``, which has no
derivative formula; the program runs it as :func:`differentiable_copy`, the same value.

Request inputs requiring grad are accepted in the shared layout, where the gradient of a request
row is the sum over its candidates (the request row *is* the input). In the drop-in and
``call_replicated`` layouts a replicated request row's gradient would land on one copy of it,
not on each as in eager, so those calls are refused.

Program choice (``runtime/choice/program_choice.py``, a separate :class:`ProgramChoice` per compiled
model, :attr:`TrainingProgram.choice`): per call bucket, a grad-mode call runs this program or
the original model itself (eager: on the call as made in the drop-in and replicated layouts, on
the request rows gathered to one per candidate in the shared layout), whichever step (forward and
backward, ``runtime/training/step_timing.py``) took less in the bucket's trials (``TRAINING_TRIALS`` each,
compared by their median); every bucket is timed (none
is settled by its FLOP count, which misses the fixed costs of autograd per op). A drop-in call
whose row count runs the original model in every bucket calls it without finding its requests.
The original model *is* eager, so gradients, buffer updates and
dropout masks (drawn in eager's order on eager's shapes by both programs) do not depend on the
choice. ``autotune=False`` (no choice) keeps this program.
"""

from __future__ import annotations

import copy
import statistics
import warnings
from collections.abc import Mapping, Sequence

import torch
from torch import fx, nn

from ...analysis.op_groups import draws_in_training
from ...errors import CompileError, InputError
from ...ir.graph_meta import PLACEMENT
from ...ir.roles import Role
from ..program.direct import direct_program
from ..choice.program_choice import TRAINING_TRIALS, ProgramChoice
from .step_timing import StepTrials
from .table_gradients import merge_table_lookups
from ..follow.weights import lookup_weight, registrations


class TrainingProgram:
    """``gm`` with its model weights read from ``model`` at each call, run under autograd (each
    ``rocs::`` op with its registered backward)."""

    def __init__(
        self,
        gm: fx.GraphModule,
        model: nn.Module,
        weight_names: Mapping[str, str],
        buffer_writes: Sequence[str] = (),
        choose: bool = True,
    ):
        self._model = model
        # Per bucket, this program or the original model (``runtime/call/train_lane.py``, ``train``).
        self.choice = ProgramChoice(TRAINING_TRIALS, statistics.median) if choose else None
        self.trials = StepTrials(self.choice) if choose else None  # timed forward + backward
        self._writes = list(buffer_writes)
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        self._names: list[str] = []
        self._specs: list[tuple] = []  # (shape, dtype, device) compiled for, per weight
        for node in gm.graph.nodes:
            if node.op != "get_attr" or node in env:
                continue
            name = weight_names.get(node.target)
            live = lookup_weight(model, name) if name is not None else None
            if live is None:
                continue  # a constant lifted from the forward: the graph module keeps it
            env[node] = graph.placeholder(f"weight_{len(self._names)}")
            env[node].meta.update(node.meta)
            self._names.append(name)
            self._specs.append((live.shape, live.dtype, live.device))
        graph.output(graph.graph_copy(gm.graph, env))
        merge_table_lookups(graph)
        for node in graph.nodes:
            if node.target is torch.ops.aten.copy.default:
                node.target = differentiable_copy
        self.graph_module = fx.GraphModule(gm, graph)
        self._weights: tuple[int, list[torch.Tensor]] | None = None
        self._direct = None
        self._cast: tuple[torch.dtype, torch.device] | None = None  # see ``following``

    def following(self, model: nn.Module, dtype: torch.dtype, device: torch.device):
        """This program (compiled from a copy of ``model`` moved to ``dtype`` and ``device``)
        reading ``model``'s own weights, cast there at each call: the cast is differentiable, so
        backward reaches ``model``'s parameters and every call sees their current values
        (``cm.to(dtype)`` of a training compile). Without a choice: the original arm would train
        the moved copy."""
        moved = copy.copy(self)
        moved._model, moved.choice, moved.trials = model, None, None
        moved._specs = [_spec(lookup_weight(model, name), name) for name in self._names]
        moved._weights, moved._cast = None, (dtype, device)
        return moved

    def _program(self):
        """The graph as a direct program (``runtime/program/direct.py``, fused ops as autograd nodes of
        their registered backward, without the dispatcher's custom-op wrappers: the runtime
        checked the call); the graph module itself under a tracer."""
        if torch.compiler.is_compiling():
            return self.graph_module
        if self._direct is None:
            self._direct = direct_program(self.graph_module, differentiable=True)
        return self._direct

    @property
    def writes_buffers(self) -> bool:
        """True when the forward writes buffers (batch norm in training mode): every call, with
        or without grad, must then run this program, which applies the writes."""
        return bool(self._writes)

    def __call__(self, inputs: list, index: torch.Tensor) -> list:
        """The graph's outputs; the trailing ones that are buffer writes are applied to the
        model's buffers, as eager's forward writes them (and left in the list, after the user's
        outputs, where the output structure does not read them)."""
        outputs = self._program()(*self.weights(), *inputs, index)
        if self._writes:
            with torch.no_grad():
                for name, value in zip(self._writes, outputs[len(outputs) - len(self._writes) :]):
                    buffer = lookup_weight(self._model, name)
                    # The batch norm's backward saved the buffer (it reads it only in eval
                    # mode); eager's in-place update happens before that save, so the version
                    # it recorded is the one after the write: keep it.
                    with torch.autograd._unsafe_preserve_version_counter(buffer):
                        buffer.copy_(value)
        return outputs

    def look_up_again(self) -> None:
        """Look the weights up by name at the next call (they were swapped without a module
        registration: FSDP2's unshard)."""
        self._weights = None

    def weights(self) -> list[torch.Tensor]:
        """The model's current tensors, in the program's order (looked up again after any module
        registration, else reused: in-place updates need no lookup)."""
        count = registrations()
        if self._weights is None or self._weights[0] != count:
            tensors = []
            for name, (shape, dtype, device) in zip(self._names, self._specs):
                live = lookup_weight(self._model, name)
                if live is None:
                    raise CompileError(
                        f"{name} is no longer a parameter or buffer of the compiled model's "
                        "original; the compiled graph reads it: compile the model again"
                    )
                if (live.shape, live.dtype, live.device) != (shape, dtype, device):
                    raise CompileError(
                        f"{name} was replaced by a tensor of shape {tuple(live.shape)}, "
                        f"{live.dtype}, {live.device}; the compiled graph is specialized to "
                        f"{tuple(shape)}, {dtype}, {device}: compile the model again"
                    )
                tensors.append(live)
            self._weights = (count, tensors)
        if self._cast is not None:
            dtype, device = self._cast
            return [_cast(t, dtype, device) for t in self._weights[1]]
        return self._weights[1]


def _spec(tensor, name: str) -> tuple:
    if tensor is None:
        raise CompileError(f"{name} is no longer a parameter or buffer of the compiled model's original")
    return tensor.shape, tensor.dtype, tensor.device


def _cast(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return t.to(device, dtype) if t.is_floating_point() else t.to(device)


def differentiable_copy(
    self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False
) -> torch.Tensor:
    """``aten.copy(self, src)``, functionalization's form of ``self.copy_(src)`` (a slice
    assignment ``h[:, 0] = x``), which autograd has no formula for: ``src`` converted to
    ``self``'s dtype and device and broadcast to its shape, a new tensor. Its gradient is
    ``src``'s (summed over the broadcast), and none reaches ``self``, which is overwritten."""
    value = src.to(dtype=self.dtype, device=self.device, non_blocking=non_blocking)
    return value.expand(self.shape).clone()


def refuse_replicated_grads(leaves: dict, requests: dict) -> None:
    """A drop-in or ``call_replicated`` call (``requests`` reduced from replicated ``leaves``)
    whose request inputs require grad: refused (the module docstring says why)."""
    if requests is leaves:
        return
    wanting = [n for n in requests if leaves[n].requires_grad]
    if wanting:
        raise InputError(
            f"request input(s) {', '.join(wanting)} require grad in a replicated call; their "
            "rows are computed once per request, so the gradient of each replicated copy is not "
            "defined: pass them with one row per request and candidate_to_request (the shared "
            "layout), where each row's gradient is the sum over its candidates"
        )


def draws_per_request(gm: fx.GraphModule) -> bool:
    """True when a random op of ``gm`` (a dropout, an attention's dropout) runs on request rows
    (``Options.request_dropout == "per_request"``): one draw per request, where the original
    model draws per impression."""
    return any(
        draws_in_training(n) and n.meta.get(PLACEMENT) == Role.REQUEST for n in gm.graph.nodes
    )


def warn_random_fallbacks(fallbacks: Sequence, per_request: bool) -> None:
    """One warning naming the request-side layers that run per impression because they draw
    random numbers (each impression its own mask, as in eager), and the layers after them with
    them; the report's fallbacks list each with its reason."""
    random = [f for f in fallbacks if "random" in f.reason]
    if not random:
        return
    layers = ", ".join(dict.fromkeys(f"{f.module or '(top level)'} ({f.reason})" for f in random))
    fix = (
        "" if per_request else
        "; options={'request_dropout': 'per_request'} draws one mask per request instead (a "
        "change of the model, docs/contract.md \"Autograd\"), or set their dropout to 0"
    )  # fmt: skip
    warnings.warn(
        f"rocs.compile(training=True): request-side layers run once per impression because "
        f"they draw random numbers, and so does what reads them: {layers}{fix}",
        stacklevel=4,  # the caller of rocs.compile
    )
