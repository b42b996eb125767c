"""Capture: an eval-mode model plus one example batch -> an ATen-level FX graph.

The model is exported with ``torch.export`` (non-strict first, strict second) with one dynamic
batch symbol shared by every batched input, so node sizes are sympy expressions in that symbol.
Parameters and buffers become ``get_attr`` nodes with known values (the analysis may read
weights); every tensor input becomes a placeholder named by its dotted input name.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import sympy
import torch
from torch import fx, nn
from torch.export import Dim
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from ..errors import CompileError, InputError
from .failure import capture_error, torch_output_silenced
from .grad_regions import inline_grad_regions
from .hooks import reject_backward_hooks
from .nested_fast_path import blocking_parameters, following_nested_path
from ..formats.leaves import (
    GRAPH_OUTPUT,
    bind_inputs,
    fresh_identifier,
    is_graph_leaf,
    is_tensor,
    match_names,
    named_leaves,
    rebuild_call,
    register_dataclasses,
)
from .reads import Reads, recording
from .side_effects import reject_renorming_embeddings, reject_state_mutation

_ASSERTION_OPS = {
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_async.msg,
}

# Sizes 0 and 1 are special-cased by PyTorch's shape system; an example with fewer rows is
# grown to this many by repeating rows (a replicated batch is a valid batch for any model).
MIN_CAPTURE_ROWS = 2


@dataclass
class CapturedGraph:
    """The result of capture; every field is plain data the later stages read."""

    graph_module: fx.GraphModule
    signature: inspect.Signature
    input_names: list[str]  # tensor leaves in placeholder order
    placeholder_of: dict[str, str]  # input name -> placeholder node name
    batched: dict[str, bool]  # input name -> carries the batch dim
    request_inputs: list[str]  # input names (leaves) declared request-side
    constant_inputs: dict[str, Any]  # non-tensor leaves baked in at capture
    out_spec: pytree.TreeSpec
    out_constants: list[Any]  # output leaves; GRAPH_OUTPUT where the graph computes one
    batch_symbol: sympy.Symbol
    route: str
    param_names: dict[str, str] = field(default_factory=dict)  # attr target -> model FQN
    # A training capture's buffer writes (batch norm's running statistics): the graph's last
    # outputs are the new values of these buffers (model FQNs), in order.
    buffer_writes: list[str] = field(default_factory=list)
    reads: Reads = field(default_factory=Reads)  # what forward read beyond tensors (``reads.py``)
    # Model names of the parameters whose ``requires_grad`` decides, with grad mode, whether
    # eager's encoders nest (``nested_fast_path.blocking_parameters``); empty when none does.
    nested_fast_path_params: list[str] = field(default_factory=list)


class _FlatForward(nn.Module):
    """Calls the model from a flat list of tensors; everything else is fixed at capture."""

    def __init__(self, model, signature, template, treespec, tensor_positions):
        super().__init__()
        self.model = model
        self._signature = signature
        self._template = template
        self._treespec = treespec
        self._tensor_positions = tensor_positions

    def forward(self, tensors: list[torch.Tensor]):
        leaves = list(self._template)
        for pos, tensor in zip(self._tensor_positions, tensors):
            leaves[pos] = tensor
        bound = pytree.tree_unflatten(leaves, self._treespec)
        args, kwargs = rebuild_call(self._signature, bound)
        out = self.model(*args, **kwargs)
        return tuple(x for x in pytree.tree_leaves(out) if is_graph_leaf(x))


def _grow_rows(value: torch.Tensor, rows: int) -> torch.Tensor:
    reps = -(-rows // value.shape[0])
    return value.repeat(reps, *([1] * (value.dim() - 1)))[:rows]


@dataclass
class ExampleCall:
    """The example call, described by leaf name: what capture and the runtime contract share."""

    signature: inspect.Signature
    bound: dict
    leaves: dict[str, Any]
    input_names: list[str]  # tensor leaves, in call order
    request_inputs: list[str]  # tensor leaves declared request-side
    batch_rows: int
    batched: dict[str, bool]
    out_spec: pytree.TreeSpec
    out_constants: list[Any]
    reads: Reads = field(default_factory=Reads)  # module -> attributes its forward read

    @property
    def constant_inputs(self) -> dict[str, Any]:
        return {n: v for n, v in self.leaves.items() if not is_tensor(v)}


def describe_example(
    model: nn.Module,
    example_args: tuple,
    example_kwargs: Mapping[str, Any],
    request_inputs: list[str],
    unbatched_inputs: Sequence[str] = (),
    training: bool = False,
) -> ExampleCall:
    """Name the example's leaves, find the batched ones, and run it once for the output layout.

    A tensor leaf is batched when its dim 0 has the example's batch size, unless
    ``unbatched_inputs`` names it (a table whose row count happens to equal the batch size).
    ``training``: the model may be in training mode (a training compile); the example run then
    leaves the random number generators as it found them."""
    if model.training and not training:
        raise InputError(
            "rocs compiles models for inference: call model.eval() first, or compile for "
            "training with rocs.compile(..., training=True)"
        )
    signature = inspect.signature(model.forward)
    bound = bind_inputs(signature, tuple(example_args), dict(example_kwargs))
    register_dataclasses(bound.values())
    leaves = named_leaves(bound)
    tensor_names = [n for n, v in leaves.items() if is_tensor(v)]
    if not tensor_names:
        raise InputError("the example inputs contain no tensors")
    covered = match_names(request_inputs, tensor_names)
    request_leaves = [leaf for hits in covered.values() for leaf in hits]
    fixed = {leaf for hits in match_names(unbatched_inputs, tensor_names).values() for leaf in hits}
    if fixed & set(request_leaves):
        raise InputError(
            f"input(s) {', '.join(sorted(fixed & set(request_leaves)))} are declared both "
            "request-side and unbatched"
        )
    candidate_leaves = [n for n in tensor_names if n not in request_leaves and n not in fixed]
    batch_rows = _batch_rows(leaves, candidate_leaves or request_leaves)
    batched = {
        n: leaves[n].dim() > 0 and leaves[n].shape[0] == batch_rows and n not in fixed
        for n in tensor_names
    }
    for name in request_leaves:
        if not batched[name]:
            raise InputError(
                f"request input {name!r} has shape {tuple(leaves[name].shape)}; request inputs "
                f"need the batch dim first ({batch_rows} rows in the example)"
            )
    args, kwargs = rebuild_call(signature, bound)
    with torch.no_grad(), _untouched(model, training), recording(model) as reads:
        out_flat, out_spec = pytree.tree_flatten(model(*args, **kwargs))
    out_constants = [GRAPH_OUTPUT if is_graph_leaf(v) else v for v in out_flat]
    return ExampleCall(
        signature, bound, leaves, tensor_names, request_leaves, batch_rows, batched, out_spec,
        out_constants, reads,
    )


@contextlib.contextmanager
def _untouched(model: nn.Module, training: bool):
    """For a training capture: the example run leaves the random generators and the model's
    buffers (batch norm's running statistics) as it found them."""
    if not training:
        yield
        return
    saved = [(b, b.clone()) for b in model.buffers() if not b.is_inference()]
    with torch.random.fork_rng():
        try:
            yield
        finally:
            for buffer, value in saved:
                buffer.copy_(value)


def capture(
    model: nn.Module,
    example_args: tuple,
    example_kwargs: Mapping[str, Any],
    request_inputs: list[str],
    strict_fallback: bool = True,
    unbatched_inputs: Sequence[str] = (),
    training: bool = False,
) -> CapturedGraph:
    """Capture ``model``; ``strict_fallback=False`` skips the strict (dynamo) route, which
    resets dynamo's caches and so must not run inside a ``torch.compile`` backend.
    ``training``: capture the model in the mode it is in (dropout in training mode stays a
    random op of the graph); otherwise the model must be in eval mode."""
    reject_renorming_embeddings(model)
    if training:
        reject_backward_hooks(model)
    call = describe_example(
        model, example_args, example_kwargs, request_inputs, unbatched_inputs, training
    )
    signature, leaves, tensor_names, batched = call.signature, call.leaves, call.input_names, call.batched
    flat, treespec = pytree.tree_flatten(call.bound)
    tensor_positions = [i for i, v in enumerate(flat) if is_tensor(v)]
    template = [None if is_tensor(v) else v for v in flat]
    rows = max(call.batch_rows, MIN_CAPTURE_ROWS)
    example = [
        _grow_rows(leaves[n], rows) if batched[n] and rows != call.batch_rows else leaves[n]
        for n in tensor_names
    ]

    wrapper = _FlatForward(model, signature, template, treespec, tensor_positions)
    wrapper.training = model.training  # the wrapper only: the model keeps its own modes
    batch = Dim("batch")
    dynamic = ([_dynamic_dims(leaves[n], batched[n], batch) for n in tensor_names],)
    failures: list[tuple[str, Exception]] = []
    routes = [("export (non-strict)", False)] + ([("export (strict)", True)] if strict_fallback else [])
    for route, strict in routes:
        try:
            # A training capture runs in grad mode, where the forward's no_grad blocks are
            # regions of the graph (``grad_regions.py``); an inference one computes without grad.
            with torch.set_grad_enabled(training), warnings.catch_warnings(), torch_output_silenced():
                warnings.simplefilter("ignore")
                with following_nested_path():
                    program = torch.export.export(
                        wrapper, (example,), dynamic_shapes=dynamic, strict=strict
                    )
                inline_grad_regions(program.graph_module)
                if _has_mutation(program.graph_module) or _has_region(program.graph_module):
                    # Functionalize (no decompositions): in-place ops and writes through views
                    # become value ops (``copy_`` into a slice -> ``slice_scatter``), so every
                    # pass reasons about values only, and regions (an autocast block) become
                    # the ATen ops they run (explicit casts). A pure flat graph skips this.
                    program = program.run_decompositions({})
            break
        except Exception as err:  # noqa: BLE001 - every failure is reported with its route
            failures.append((route, err))
    else:
        raise capture_error(failures)

    gm, placeholder_of, param_names, buffer_writes = _lift_to_attrs(program, tensor_names, training)
    nested_params = blocking_parameters(gm, param_names, model)
    symbol = _batch_symbol(gm, placeholder_of, batched)
    return CapturedGraph(
        graph_module=gm,
        signature=signature,
        input_names=tensor_names,
        placeholder_of=placeholder_of,
        batched=batched,
        request_inputs=call.request_inputs,
        constant_inputs=call.constant_inputs,
        out_spec=call.out_spec,
        out_constants=call.out_constants,
        batch_symbol=symbol,
        route=route,
        param_names=param_names,
        reads=call.reads,
        buffer_writes=buffer_writes,
        nested_fast_path_params=nested_params,
    )


def _dynamic_dims(value: torch.Tensor, batched: bool, batch: Dim) -> dict | None:
    """``{0: batch}`` for a batched input, plus the other dims the example marks dynamic with
    ``torch._dynamo.mark_dynamic`` (a padded length that changes between calls)."""
    dims: dict = {d: Dim.DYNAMIC for d in getattr(value, "_dynamo_dynamic_indices", ()) if d}
    if batched:
        dims[0] = batch
    return dims or None


def _batch_rows(leaves: dict, names: list[str]) -> int:
    counts = collections.Counter(leaves[n].shape[0] for n in names if leaves[n].dim() > 0)
    if not counts:
        raise InputError("no input has a batch dimension")
    return counts.most_common(1)[0][0]


def _lift_to_attrs(program, tensor_names, training: bool = False):
    """Copy the exported graph, turning parameter/buffer/constant inputs into get_attr nodes.
    ``training``: writes to buffers are kept, as the graph's last outputs (the user's outputs
    first), and their buffers' names returned; the runtime applies them after each call."""
    src = program.graph_module.graph
    specs = program.graph_signature.input_specs
    buffer_writes = reject_state_mutation(program, buffers_allowed=training)
    root = nn.Module()
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    taken: set[str] = set()
    placeholder_of, param_names = {}, {}
    user_index = 0
    placeholders = [n for n in src.nodes if n.op == "placeholder"]
    state = {**program.state_dict, **program.constants}
    attr_nodes = []
    for node, spec in zip(placeholders, specs):
        if spec.kind == InputKind.USER_INPUT:
            name = tensor_names[user_index]
            user_index += 1
            new = graph.placeholder(fresh_identifier(name, taken))
            new.meta.update(node.meta)
            placeholder_of[name] = new.name
            env[node] = new
        else:
            attr_nodes.append((node, spec))
    for node, spec in attr_nodes:
        fqn = spec.target.removeprefix("model.")
        attr = fresh_identifier(fqn, taken)
        value = state[spec.target]
        root.register_buffer(attr, value.detach() if isinstance(value, torch.Tensor) else value)
        new = graph.get_attr(attr)
        new.meta.update(node.meta)
        param_names[attr] = fqn
        env[node] = new
    for node in src.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "call_function" and node.target in _ASSERTION_OPS:
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    if buffer_writes:
        output = next(n for n in graph.nodes if n.op == "output")
        values = list(output.args[0])
        count = len(buffer_writes)  # export puts the writes first
        output.args = (tuple(values[count:] + values[:count]),)
    gm = fx.GraphModule(root, graph)
    gm.graph.lint()
    _reject_mutation(gm)
    _views_to_reshapes(gm)
    return gm, placeholder_of, param_names, buffer_writes


# Views that functionalization chose by the example's strides (``reshape`` of a tensor that
# happened to be contiguous becomes ``view``).
_STRIDE_DEPENDENT_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


def _views_to_reshapes(gm: fx.GraphModule) -> None:
    """``view(x, s)`` -> ``reshape(x, s)``: equal values, and in a functional graph aliasing is
    unobservable. A rewrite may give ``x`` another layout than capture saw (a fused op returns a
    contiguous tensor where SDPA returned a transposed one), where ``view`` would fail."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _STRIDE_DEPENDENT_VIEWS:
            node.target = torch.ops.aten.reshape.default
    gm.recompile()


def _has_mutation(gm: fx.GraphModule) -> bool:
    return any(
        isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
        for n in gm.graph.nodes
        if n.op == "call_function"
    )


def _has_region(gm: fx.GraphModule) -> bool:
    """A higher-order op (``wrap_with_autocast``, say) holding a subgraph of its own."""
    return any(
        isinstance(n.target, torch._ops.HigherOrderOperator)
        for n in gm.graph.nodes
        if n.op == "call_function"
    )


def _reject_mutation(gm: fx.GraphModule) -> None:
    """A forward that writes to a buffer or an input has state the rewrite cannot share."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if not target._schema.is_mutable:
            continue
        for arg, schema_arg in zip(node.args, target._schema.arguments):
            written = schema_arg.alias_info is not None and schema_arg.alias_info.is_write
            if written and isinstance(arg, fx.Node) and arg.op in ("get_attr", "placeholder"):
                kind = "buffer" if arg.op == "get_attr" else "input"
                raise CompileError(
                    f"the model's forward mutates {kind} {arg.target!r} in place ({target}); "
                    "rocs needs a forward without side effects"
                )


def _batch_symbol(gm, placeholder_of, batched) -> sympy.Symbol:
    nodes = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for name, is_batched in batched.items():
        if is_batched:
            size = nodes[placeholder_of[name]].meta["val"].shape[0]
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                return size.node.expr
    raise CompileError(
        "export specialized the batch dimension to a constant; the model's forward depends on "
        "the exact batch size"
    )
