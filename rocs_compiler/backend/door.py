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

The door is split by concern: ``graph_compiler.py`` (:class:`RocsBackend`, what dynamo calls
with each graph), ``subgraph.py`` (one graph's compile, variants and plain fallback, and the
shared-call state), ``request_names.py`` (request names in dynamo's frames); this module holds
the entry points and :func:`shared_call`.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import fx, nn

from ..kernels.index_contract import check_candidate_to_request
from ..errors import InputError
from ..formats.leaves import (
    bind_inputs, given_by_name, is_tensor, named_leaves, parameter_order, replace_leaves,
)  # fmt: skip
from ..options import BackendOptions
from .graph_compiler import RocsBackend
from .request_names import request_covers
from .subgraph import SHARED_CALL, SharedCall
from .user_frame import call_compiled

__all__ = ["RocsBackend", "backend", "rocs_backend", "shared_call"]


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
        tuple(request_inputs) if request_inputs is not None else _backend_request_inputs(compiled)
    )
    signature, order = _signature_of(_original_callable(compiled))
    named = given_by_name(order, args, kwargs)
    leaves = named_leaves(named if named is not None else bind_inputs(signature, args, kwargs))
    covered, missing = _request_leaves(names, tuple(leaves))
    shared = {n: leaves[n] for n in covered if is_tensor(leaves[n])}
    if len(shared) != len(covered):  # a leaf that is not a tensor stands for no request
        missing = _request_leaves(names, tuple(shared))[1]
    if missing:
        raise InputError(f"missing request input(s): {', '.join(missing)}")
    index = candidate_to_request
    rows = {n: t.shape[0] if t.dim() else None for n, t in shared.items()}
    if len(set(rows.values())) != 1 or None in rows.values():
        raise InputError(f"request inputs disagree on the number of rows R: {rows}")
    num_requests = next(iter(rows.values()))
    # On the CPU the gather below checks the index's range as it reads (``runtime/call/bound.py``).
    check_candidate_to_request(index, None, num_requests, check_range=index.is_cuda)
    try:
        replicated = {n: t.index_select(0, index) for n, t in shared.items()}
    except IndexError:
        check_candidate_to_request(index, None, num_requests)  # names the value out of range
        raise
    if named is not None and all(n in named for n in shared):  # top-level tensors: no tree
        call_args, call_kwargs = (), {**named, **replicated}
    else:
        call_args, call_kwargs = replace_leaves(signature, args, kwargs, replicated)
    state = SharedCall(index, shared, replicated)
    token = SHARED_CALL.set(state)
    try:
        out = call_compiled(compiled, call_args, call_kwargs)
    finally:
        SHARED_CALL.reset(token)
    if not state.graphs_shared:
        warnings.warn(
            "rocs.shared_call: no compiled graph received the request inputs unchanged, so the "
            "call ran in replicated layout (exact, without sharing); is the model compiled with "
            "the rocs backend?",
            stacklevel=2,
        )
    return out


@functools.lru_cache(maxsize=256)
def _request_leaves(names: tuple[str, ...], leaves: tuple[str, ...]) -> tuple[tuple, tuple]:
    """The leaves a request name covers, and the names that cover none, read once per set of
    names (a served model's calls name the same leaves every time)."""
    covered = tuple(n for n in leaves if any(request_covers(r, n) for r in names))
    missing = tuple(r for r in names if not any(request_covers(r, n) for n in covered))
    return covered, missing


def _read_once(cache: weakref.WeakKeyDictionary, key: Any, read: Callable, arg: Any) -> Any:
    """``cache[key]``, filled by ``read(arg)`` at the first call; a key that is not weakly
    referenceable is read every call."""
    try:
        return cache[key]
    except (KeyError, TypeError):
        pass
    found = read(arg)
    try:
        cache[key] = found
    except TypeError:
        pass
    return found


_SIGNATURES: "weakref.WeakKeyDictionary[Callable, tuple]" = weakref.WeakKeyDictionary()


def _signature_of(original: Callable) -> tuple[inspect.Signature, Optional[tuple[str, ...]]]:
    """The signature of the model's forward and its parameter order (``parameter_order``), read
    once per callable."""
    key = getattr(original, "__func__", original)  # a bound method is made anew on every read
    return _read_once(_SIGNATURES, key, _read_signature, original)


def _read_signature(original: Callable) -> tuple[inspect.Signature, Optional[tuple[str, ...]]]:
    signature = inspect.signature(original)
    return signature, parameter_order(signature)


def _original_callable(compiled: Callable) -> Callable:
    modules = getattr(compiled, "_modules", None)  # an optimized module holds its model there
    orig = modules.get("_orig_mod") if isinstance(modules, dict) else None
    if orig is None:
        orig = getattr(compiled, "_orig_mod", None)
    if isinstance(orig, nn.Module):
        return orig.forward
    return getattr(compiled, "_torchdynamo_orig_callable", compiled)


_REQUEST_INPUTS: "weakref.WeakKeyDictionary[Callable, tuple]" = weakref.WeakKeyDictionary()


def _backend_request_inputs(compiled: Callable) -> tuple[str, ...]:
    """The request inputs of the rocs backend behind a ``torch.compile`` result, if any (read
    once per compiled callable: its backend is fixed when it is made)."""
    return _read_once(_REQUEST_INPUTS, compiled, _read_backend_request_inputs, compiled)


def _read_backend_request_inputs(compiled: Callable) -> tuple[str, ...]:
    from torch._dynamo.eval_frame import innermost_backend

    callback = getattr(getattr(compiled, "dynamo_ctx", None), "callback", None)
    inner = innermost_backend(callback) if callback is not None else None
    for _ in range(4):  # see through wrappers such as dynamo's CompileCounterWithBackend
        if isinstance(inner, RocsBackend):
            return tuple(inner.request_inputs)
        options = (getattr(inner, "kwargs", None) or {}).get("options") or {}
        if getattr(inner, "compiler_fn", None) is rocs_backend and "request_inputs" in options:
            return tuple(options["request_inputs"])
        inner = getattr(inner, "backend", None) or getattr(inner, "compiler_fn", None)
    raise InputError(
        "cannot tell which inputs are request-side for this callable; pass "
        "shared_call(..., request_inputs=[...])"
    )
