"""The ``torch.compile`` backend: ``torch.compile(model, backend="rocs", options={...})``.

The backend is registered only through the ``torch_dynamo_backends`` entry point declared in
``pyproject.toml``, so ``backend="rocs"`` works after ``pip install`` without importing this
package; ``rocs.backend(request_inputs=...)`` returns the same backend as an object.

Dynamo hands the backend one FX graph per frame (several when the model has graph breaks) whose
placeholders are the frame's tensors, module state and symbolic sizes. Each placeholder's
``grapharg.source`` says where the value came from:

- ``L['user_ids']``, ``L['features']['user_age']``: a model input, named ``user_ids`` and
  ``features.user_age`` exactly as ``rocs.compile`` names inputs;
- ``L['self']._modules[...]._parameters['weight']``, globals, closures: module state, a constant
  read at compile time (a later in-place update or a swapped tensor triggers a rebuild);
- ``L['user_ids'].size()[0]``: a size, recomputed from the input at every call.

The graph is wrapped in an ``nn.Module`` whose forward takes the named inputs and compiled with the
ordinary pipeline (``rocs.compile``); the rewritten graph is then lowered with Inductor unless
``options={"inductor": False}``. Before the rewrite, PyTorch's fused transformer fast paths in
the graph become the plain ops they compute (``fast_paths.py``). A subgraph that sees no request
input, or whose rewrite shares nothing (``unshared.py``: dynamo traces its frame once more), has
nothing to share and runs as Inductor compiles it, at Inductor's cost per call.

Layouts. Calls through ``torch.compile`` are drop-in (replicated layout) and exact. Dynamo traces
the original Python code, which cannot run on shared-layout inputs, so shared-layout calls go
through :func:`shared_call`, which gathers the request inputs once for dynamo's guards and hands
the compiled graphs the R-row tensors plus ``candidate_to_request``.

Batch sizes. The returned callables accept any batch. Dynamo decides when to retrace: with
``dynamic=True`` the first graph is already dynamic (a batch of 1 is still specialized by dynamo's
0/1 rule unless ``torch.fx.experimental._config.backed_size_oblivious`` is set); with the default
``dynamic=None`` the second batch size retraces once with a dynamic batch (automatic dynamic
shapes) and no later size does.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import fx, nn

from .dynamo_graph import Slot, classify, dotted, graph_model
from .fast_paths import decompose_fast_paths
from ..kernels.index_contract import check_candidate_to_request
from ..errors import CompileError, InputError, OptionsError
from ..formats.leaves import bind_inputs, covers, is_tensor, named_leaves, nest, replace_leaves
from ..options import BackendOptions
from ..runtime import CompiledModel, no_backward
from ..runtime.weights import tensor_version
from .lowering import Lowered, lower_plain
from .unshared import UNSHARED, frame_code, unshared_reason

__all__ = ["RocsBackend", "backend", "rocs_backend", "shared_call"]

# -- shared-layout calls --------------------------------------------------------------------------


@dataclass
class _SharedCall:
    index: torch.Tensor
    shared: dict[str, torch.Tensor]  # request leaf name -> R-row tensor
    replicated: dict[str, torch.Tensor]  # request leaf name -> the N-row tensor handed to dynamo
    graphs_shared: int = 0


_SHARED: contextvars.ContextVar[Optional[_SharedCall]] = contextvars.ContextVar(
    "rocs_shared_call", default=None
)


# -- one compiled dynamo graph --------------------------------------------------------------------


@dataclass
class _Variant:
    """The rocs compilation of one dynamo graph for one set of non-batch shapes."""

    model: Any  # the rocs CompiledModel (runs the FX graph)
    runner: Callable  # the same contract, running the lowered graph


@dataclass
class _Subgraph:
    """What the backend returns to dynamo for one graph: callable with the graph's arguments."""

    gm: fx.GraphModule
    slots: list[Slot]
    request_inputs: list[str]
    options: BackendOptions
    consts: list[tuple[int, torch.Tensor, int]] = field(default_factory=list)
    values: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # baked, compared
    variants: dict = field(default_factory=dict)
    plain: Optional[Callable] = None  # set when rocs does not rewrite this graph
    # Called when the rewrite shares nothing: True when dynamo will trace the frame again
    # (``UnsharedGraphs.retrace``), whose graph the backend then lowers with Inductor at once.
    retrace: Optional[Callable[[str], bool]] = None
    fallback_reason: Optional[str] = None
    static_rows: Optional[int] = None  # the batch size of a graph dynamo traced with static shapes

    @property
    def compiled_model(self):
        """The rocs ``CompiledModel`` of the most recent variant (None if not rewritten)."""
        return next(reversed(self.variants.values())).model if self.variants else None

    def __call__(self, *args):
        if self.plain is not None:
            return self.plain(*args)
        if self._state_changed(args):
            self.variants.clear()  # weights or scalars changed since compile time: rewrite again
        leaves = {s.path: args[i] for i, s in enumerate(self.slots) if s.kind == "input"}
        variant = self.variants.get(self._key(leaves)) or self._compile(args)
        if variant is None:
            return self.plain(*args)
        state = _SHARED.get()
        if state is not None and self._takes_shared(state, leaves):
            state.graphs_shared += 1
            for path in leaves:
                name = dotted(path)
                if name in state.shared:
                    leaves[path] = state.shared[name]
            out = variant.runner(**nest(leaves), candidate_to_request=state.index)
        else:
            out = variant.runner(**nest(leaves))
        return self._refuse_backward(list(out))

    def _refuse_backward(self, out: list) -> list:
        """In grad mode, with module state requiring grad (a model trained through
        ``torch.compile``), outputs get a ``grad_fn`` whose backward raises, naming the training
        compile, instead of coming back detached (``runtime/no_backward.py``)."""
        if not torch.is_grad_enabled():
            return out
        anchor = no_backward.first_requiring_grad(value for _, value, _ in self.consts)
        if anchor is None:
            return out
        return no_backward.attach(out, [True] * len(out), anchor)

    def _state_changed(self, args: tuple) -> bool:
        return any(
            args[i] is not value or tensor_version(value) != version
            for i, value, version in self.consts
        ) or any(not _same_value(args[i], value) for i, value in self.values)

    def _takes_shared(self, state: _SharedCall, leaves: dict) -> bool:
        requests = [p for p in leaves if dotted(p) in self._request_leaves()]
        return bool(requests) and all(
            state.replicated.get(dotted(p)) is leaves[p] for p in requests
        )

    def _request_leaves(self) -> set[str]:
        model = self.compiled_model
        return set(model.contract.request_inputs) if model is not None else set()

    def _key(self, leaves: dict) -> tuple:
        return tuple((tuple(t.shape[1:]), t.dim(), t.dtype, t.device) for t in leaves.values())

    def _compile(self, args: tuple) -> Optional[_Variant]:
        from .. import api

        self.consts = [
            (i, args[i], tensor_version(args[i]))
            for i, s in enumerate(self.slots)
            if s.kind == "const"
        ]
        self.values = [
            (i, args[i].detach().clone()) for i, s in enumerate(self.slots) if s.kind == "value"
        ]
        # Aliases, not the caller's tensors: export marks its example inputs dynamic, and dynamo's
        # guards on the frame being compiled must not see that.
        leaves = {s.path: args[i].detach() for i, s in enumerate(self.slots) if s.kind == "input"}
        model = graph_model(decompose_fast_paths(self.gm), self.slots, list(args))
        try:
            compiled = api.compile(
                model,
                self.request_inputs,
                example_kwargs=nest(leaves),
                options=self.options,
            )
        except CompileError as err:
            hint = ""
            if self.static_rows is not None:
                hint = (
                    f" (dynamo traced it with a static batch of {self.static_rows} rows; "
                    "torch.compile(..., dynamic=True) gives rocs a dynamic batch)"
                )
            message = "\n".join(str(err).splitlines()[:4])
            warnings.warn(
                f"rocs: could not rewrite a dynamo graph, it runs without sharing{hint}: {message}",
                stacklevel=2,
            )
            self.fallback_reason = str(err)
            # Dynamo's compile of this frame is over: ``compile_fx`` would trace the graph
            # outside dynamo's context (and fail on a baked scalar's ``.item()``), so the graph
            # is compiled as a frame of its own at its first call instead.
            self.plain = Lowered(self.gm, self.options.inductor, functional=False)
            return None
        unshared = unshared_reason(compiled)
        if unshared is not None:
            self.fallback_reason = unshared
            if not self.options.inductor or (self.retrace is not None and self.retrace(unshared)):
                self.plain = self.gm.forward  # until dynamo traces the frame again (next call)
            else:
                self.plain = Lowered(self.gm, True, functional=False)
            return None
        # Without Inductor the compiled model runs its graph itself (as a direct program).
        runner = compiled
        if self.options.inductor and isinstance(compiled, CompiledModel):  # not column lanes
            runner = compiled.with_graph(Lowered(compiled.graph_module, True))
        variant = _Variant(compiled, runner)
        self.variants[self._key(leaves)] = variant
        return variant


def _same_value(now: torch.Tensor, baked: torch.Tensor) -> bool:
    """Whether a scalar or NumPy array dynamo passed as a tensor still holds the baked value."""
    return now.shape == baked.shape and now.dtype == baked.dtype and torch.equal(now, baked)


# -- the backend ----------------------------------------------------------------------------------


class RocsBackend:
    """A ``torch.compile`` backend with fixed options: ``torch.compile(model, backend=obj)``.

    ``subgraphs`` lists what it compiled (one entry per dynamo graph), for inspection and tests.
    """

    def __init__(
        self,
        request_inputs: Sequence[str] | str,
        options: Optional[Mapping[str, Any] | BackendOptions] = None,
    ):
        self.options = BackendOptions.from_mapping(options, where="rocs.backend")
        if self.options.training:
            raise OptionsError(
                "torch.compile(backend='rocs')",
                [
                    "option 'training' is not supported by the torch.compile backend (AOTAutograd "
                    "would hand it a forward graph without the parameters' gradients); compile "
                    "for training with rocs.compile(model, request_inputs, ..., training=True)"
                ],
                BackendOptions.describe(),
            )
        if isinstance(request_inputs, str):
            request_inputs = [request_inputs]
        if not request_inputs:
            raise ValueError("the rocs backend needs request_inputs (a list of input names)")
        self.request_inputs = _without_kjt_keys(request_inputs)
        self.subgraphs: list[_Subgraph] = []

    def __repr__(self) -> str:
        return f"RocsBackend(request_inputs={self.request_inputs!r}, options={self.options!r})"

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Callable:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        slots = [classify(n) for n in placeholders]
        inputs = [s.name for s in slots if s.kind == "input"]
        present = [r for r in self.request_inputs if any(_covers(r, n) for n in inputs)]
        unknown, nested = _unknown_request_names(self.request_inputs, present)
        if unknown and not nested:
            raise InputError(unknown)
        subgraph = _Subgraph(gm, slots, present, self.options)
        if unknown:
            warnings.warn(f"rocs: {unknown}; this graph runs without sharing", stacklevel=2)
            subgraph.fallback_reason = "its request inputs cannot be named here"
        unsupported = [s.name for s in slots if s.kind == "unsupported"]
        rows = _static_rows(placeholders, slots)
        if subgraph.fallback_reason is not None:
            pass
        elif unsupported:
            subgraph.fallback_reason = f"graph inputs rocs cannot name: {', '.join(unsupported)}"
            warnings.warn(
                f"rocs: {subgraph.fallback_reason}; this graph runs without sharing", stacklevel=2
            )
        elif not present:
            subgraph.fallback_reason = "no request input reaches this graph"
        elif rows is not None and rows <= 1:
            # Dynamo specializes a batch of one; one candidate has nothing to share.
            subgraph.fallback_reason = "static batch of one row"
        elif UNSHARED.reason(gm, present) is not None:  # its rewrite shared nothing before
            subgraph.fallback_reason = UNSHARED.reason(gm, present)
        if subgraph.fallback_reason is not None:
            subgraph.plain = lower_plain(gm, example_inputs, self.options.inductor)
        else:
            # The rewrite runs at the first call, not here: export inside dynamo's tracing context
            # would share dynamo's shape environment and add guards on export's own inputs.
            subgraph.static_rows = rows
            subgraph.retrace = functools.partial(UNSHARED.retrace, gm, present, frame_code())
            _warn_if_grad(example_inputs)
        self.subgraphs.append(subgraph)
        return subgraph


def _without_kjt_keys(names: Sequence[str]) -> list[str]:
    """``names`` without ``KeyedJaggedTensor`` keys, which have no meaning in a dynamo graph:
    dynamo traces TorchRec's lookups as one jagged ``embedding_bag`` over every row of the
    batch, which no request name can split. They are dropped with a warning, and what they
    name runs unshared (exactly); column ranges stay (``_covers`` maps them to their argument,
    and ``rocs.compile`` wraps the dynamo graph in column lanes as it wraps a model)."""
    lanes = [n for n in names if "[" in n]
    keys = [n for n in lanes if not n.split("[", 1)[1].lstrip().startswith(":")]
    if keys:
        warnings.warn(
            f"rocs: the torch.compile backend cannot follow KeyedJaggedTensor keys "
            f"({', '.join(map(repr, keys))}) into dynamo's graphs, where TorchRec's lookups are one "
            "jagged embedding_bag over the whole batch: they run unshared. rocs.compile(model, "
            "request_inputs, example_inputs=...) shares them",
            stacklevel=3,
        )
    return [n for n in names if n not in keys]


def _static_rows(placeholders: list[fx.Node], slots: list[Slot]) -> Optional[int]:
    """The batch size dynamo specialized this graph to, or None when the batch dim is symbolic."""
    rows = []
    for node, slot in zip(placeholders, slots):
        value = node.meta.get("example_value")
        if slot.kind == "input" and isinstance(value, torch.Tensor) and value.dim():
            if isinstance(value.shape[0], torch.SymInt):
                return None
            rows.append(int(value.shape[0]))
    return max(rows) if rows else None


def _covers(request: str, leaf: str) -> bool:
    if "[" in request:  # a column range names columns of its argument (``formats/columns.py``)
        request = request.split("[", 1)[0].strip()
    return covers(request, leaf)


def _unknown_request_names(requested: list[str], present: list[str]) -> tuple[Optional[str], bool]:
    """(what is wrong, whether the frame is nested) when a request name is not an argument of
    the frame being compiled.

    Only the first frame of a function is checked: a frame resumed after a graph break sees only
    the locals still alive, and an input missing there is not a mistake. A *nested* frame is a
    function that user code called after a graph break (a helper taking the history as ``x``):
    its arguments carry other names, so the caller runs it unshared; for the frame the user
    compiled, an unknown name is a misspelling and the caller raises.
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:
        return None, False
    code = getattr(tx, "f_code", None)
    if code is None or code.co_name.startswith("torch_dynamo_resume_in_"):
        return None, False
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    arguments = [a for a in code.co_varnames[:count] if a != "self"]
    unknown = [r for r in requested if r not in present and r.split(".")[0] not in arguments]
    if not unknown:
        return None, False
    message = (
        f"unknown request input(s) {', '.join(map(repr, unknown))}; the compiled function "
        f"{code.co_name}() takes: {', '.join(arguments)}"
    )
    return message, _called_by_user_code()


def _called_by_user_code() -> bool:
    """True when the frame dynamo is compiling was called from outside torch: by the user's own
    function after a graph break, rather than by ``torch.compile``'s wrapper. That caller is the
    frame below dynamo's frame-conversion callback on the Python stack."""
    frame, caller = inspect.currentframe(), None
    while frame is not None:
        if frame.f_code.co_filename.endswith(_CONVERT_FRAME):
            caller = frame.f_back
        frame = frame.f_back
    return caller is not None and not caller.f_code.co_filename.startswith(_TORCH_DIR)


_TORCH_DIR = os.path.dirname(torch.__file__)
_CONVERT_FRAME = os.path.join("_dynamo", "convert_frame.py")


_GRAD_WARNED = False


def _warn_if_grad(example_inputs: Sequence[Any]) -> None:
    global _GRAD_WARNED
    if _GRAD_WARNED or not torch.is_grad_enabled():
        return
    if any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs):
        _GRAD_WARNED = True
        warnings.warn(
            "rocs compiles for inference: outputs carry no gradient; call the model under "
            "torch.no_grad() or torch.inference_mode(), or compile for training with "
            "rocs.compile(model, request_inputs, ..., training=True)",
            stacklevel=3,
        )


def backend(request_inputs: Sequence[str] | str, **options: Any) -> RocsBackend:
    """The rocs backend with fixed options: ``torch.compile(model, backend=rocs.backend(...))``.

    ``request_inputs`` are named as in :func:`rocs.compile`; ``options`` are the fields of
    :class:`BackendOptions` (the pipeline options plus ``inductor``), checked here.
    """
    return RocsBackend(request_inputs, options)


def rocs_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Optional[Mapping[str, Any]] = None,
    mode: Optional[str] = None,
    **kwargs: Any,
) -> Callable:
    """The ``torch_dynamo_backends`` entry point behind ``backend="rocs"``.

    ``torch.compile(model, backend="rocs", options={"request_inputs": [...], ...})`` passes the
    options here: ``request_inputs`` and the fields of :class:`BackendOptions`. ``mode`` is
    accepted and ignored (rocs has a single mode).
    """
    merged = {**dict(options or {}), **kwargs}
    if "request_inputs" not in merged:
        raise InputError(
            "the rocs backend needs to know the request-side inputs: "
            "torch.compile(model, backend='rocs', options={'request_inputs': [...]})"
        )
    request_inputs = merged.pop("request_inputs")
    checked = BackendOptions.from_mapping(merged, where="torch.compile(backend='rocs')")
    return RocsBackend(request_inputs, checked)(gm, example_inputs)


# -- shared layout through torch.compile ----------------------------------------------------------


def shared_call(
    compiled: Callable,
    *args: Any,
    candidate_to_request: torch.Tensor,
    request_inputs: Optional[Sequence[str]] = None,
    **kwargs: Any,
):
    """Call a ``torch.compile(..., backend="rocs")`` model in shared layout.

    Request inputs have R rows, candidate inputs N rows, ``candidate_to_request`` is int64 [N].
    The result equals the model on the replicated batch. Dynamo guards and traces the original
    Python code, which expects replicated inputs, so the request inputs are gathered once to N
    rows for dynamo; every compiled graph that receives them untouched computes from the R-row
    tensors instead (graphs behind a graph break that see derived values run in drop-in layout,
    which is exact too).

    ``request_inputs`` defaults to the ones the backend was given.
    """
    names = (
        list(request_inputs) if request_inputs is not None else _backend_request_inputs(compiled)
    )
    original = _original_callable(compiled)
    signature = inspect.signature(original)
    leaves = named_leaves(bind_inputs(signature, args, kwargs))
    requests = [n for n in leaves if any(_covers(r, n) for r in names) and is_tensor(leaves[n])]
    missing = [r for r in names if not any(_covers(r, n) for n in requests)]
    if missing:
        raise InputError(f"missing request input(s): {', '.join(missing)}")
    index = candidate_to_request
    rows = {n: leaves[n].shape[0] if leaves[n].dim() else None for n in requests}
    if len(set(rows.values())) != 1 or None in rows.values():
        raise InputError(f"request inputs disagree on the number of rows R: {rows}")
    check_candidate_to_request(index, None, next(iter(rows.values())))
    replicated = {n: leaves[n].index_select(0, index) for n in requests}
    call_args, call_kwargs = replace_leaves(signature, args, kwargs, replicated)
    state = _SharedCall(index, {n: leaves[n] for n in requests}, replicated)
    token = _SHARED.set(state)
    try:
        out = compiled(*call_args, **call_kwargs)
    finally:
        _SHARED.reset(token)
    if not state.graphs_shared:
        warnings.warn(
            "rocs.shared_call: no compiled graph received the request inputs unchanged, so the "
            "call ran in replicated layout (exact, without sharing); is the model compiled with "
            "the rocs backend?",
            stacklevel=2,
        )
    return out


def _original_callable(compiled: Callable) -> Callable:
    orig = getattr(compiled, "_orig_mod", None)
    if isinstance(orig, nn.Module):
        return orig.forward
    return getattr(compiled, "_torchdynamo_orig_callable", compiled)


def _backend_request_inputs(compiled: Callable) -> list[str]:
    """The request inputs of the rocs backend behind a ``torch.compile`` result, if any."""
    from torch._dynamo.eval_frame import innermost_backend

    callback = getattr(getattr(compiled, "dynamo_ctx", None), "callback", None)
    inner = innermost_backend(callback) if callback is not None else None
    for _ in range(4):  # see through wrappers such as dynamo's CompileCounterWithBackend
        if isinstance(inner, RocsBackend):
            return inner.request_inputs
        options = (getattr(inner, "kwargs", None) or {}).get("options") or {}
        if getattr(inner, "compiler_fn", None) is rocs_backend and "request_inputs" in options:
            return list(options["request_inputs"])
        inner = getattr(inner, "backend", None) or getattr(inner, "compiler_fn", None)
    raise InputError(
        "cannot tell which inputs are request-side for this callable; pass "
        "shared_call(..., request_inputs=[...])"
    )
