"""CompiledModel: validates inputs, builds ``candidate_to_request``, runs the shared graph.

Two calling conventions:

- shared layout: request inputs with R rows, candidate inputs with N rows, and
  ``candidate_to_request`` (int64 [N], values in [0, R));
- drop-in: the original call with replicated inputs; consecutive rows with equal request inputs
  form one request.

The module holds no per-call state, so concurrent calls are safe; it has no shape
specialization, so any R and N run without recompiling. It computes with the original model's
current weights: in-place updates and reassigned parameters are seen (``runtime/weights.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from typing import Any, Callable, Mapping, Optional

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..errors import CompileError, InputError
from ..ir.graph_meta import PLACEMENT
from ..kernels.index_contract import (
    check_candidate_to_request,
    check_index_range,
    distinct_values,
    index_trusted,
)
from ..formats.base import REPLICATED, InputFormat, ProgramCall
from ..kernels.request_groups import call_groups
from ..ir.roles import Role
from . import no_backward
from .input_checks import InputSpecs, row_count_error
from .mislabel import MislabelWatch
from .plain import PlainProgram, constant_output_positions
from .original_arm import OriginalArm
from .program_choice import (
    CLEAR_GAIN,
    CLEAR_SAVING,
    DROPIN_MARGIN,
    margin_for,
    PLAIN,
    SHARED,
    ProgramChoice,
    bucket,
    call_clock,
    now,
)
from .distributed import DDPWatch, sharded_by_fsdp, unshard_fsdp
from .dtype_move import dtype_move, keep_integer_dtypes
from .module_state import share_module_state
from .guards import NO_GUARDS
from .request_detection import detect_requests, reduce_rows
from .settled_plain import (
    NOT_TAKEN,
    call_with_rows,
    run_settled_as_called,
    run_as_original,
    run_kept_original,
    run_settled_original,
    run_settled_plain,
)
from .training import refuse_replicated_grads
from .weights import WeightRefresh
from ..formats.leaves import GRAPH_OUTPUT, bind_inputs, is_tensor, named_leaves, replace_leaves


class InputContract:
    """What a compiled model expects: names, which leaves are request-side or batched."""

    def __init__(self, signature, input_names, request_inputs, batched, constant_inputs, out_spec, out_constants):
        self.signature: inspect.Signature = signature
        self.input_names: list[str] = list(input_names)
        self.request_inputs: list[str] = list(request_inputs)
        self.batched: dict[str, bool] = dict(batched)
        self.constant_inputs: dict[str, Any] = dict(constant_inputs)
        self.out_spec = out_spec
        self.out_constants = list(out_constants)
        # A forward returning one tensor: no tree to rebuild.
        self._single_output = (
            len(self.out_constants) == 1
            and self.out_constants[0] is GRAPH_OUTPUT
            and isinstance(out_spec, pytree.TreeSpec)
            and out_spec.is_leaf()
        )
        # A forward whose parameters are exactly the tensor inputs can take keyword calls as they
        # are (no binding, no flattening); None when any input is nested or non-tensor.
        params = signature.parameters
        plain = all(p.kind == p.POSITIONAL_OR_KEYWORD or p.kind == p.KEYWORD_ONLY for p in params.values())
        flat = plain and not self.constant_inputs and set(params) == set(self.input_names)
        self._keyword_names = frozenset(self.input_names) if flat else None
        # Keyword calls whose values are tensors or dicts of tensors (one level) are named
        # without binding or a tree walk when every parameter is given and none is a constant.
        nested = plain and not self.constant_inputs
        self._param_names = frozenset(params) if nested else None
        # Positional calls of such a forward are named by parameter order, without binding.
        self._param_order = tuple(params) if nested and all(
            p.kind == p.POSITIONAL_OR_KEYWORD for p in params.values()
        ) else None
        self._input_set = frozenset(self.input_names)
        self.batched_inputs = [n for n in self.input_names if self.batched[n]]
        self.candidate_inputs = [n for n in self.batched_inputs if n not in self.request_inputs]
        self._first_batched = _locator(signature, self.batched_inputs[:1]) if nested else None

    @property
    def places_rows(self) -> bool:
        """Whether :meth:`first_rows` can read a call's rows (its first batched input is a
        parameter, or one key or field of one)."""
        return self._first_batched is not None

    def first_rows(self, args: tuple, kwargs: dict) -> Optional[int]:
        """The row count of the call's first batched input, read without naming the call's
        leaves, for a parameter that is that tensor or a dict or batch object holding it; None
        when it is not found so (the caller names the leaves)."""
        where = self._first_batched
        if where is None:
            return None
        param, position, key = where
        if param in kwargs:
            value = kwargs[param]
        elif position is not None and position < len(args):
            value = args[position]
        else:
            return None
        if key is not None:
            value = value.get(key) if type(value) is dict else getattr(value, key, None)
        if not isinstance(value, torch.Tensor) or not value.dim():
            return None
        return value.shape[0]

    def leaves(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        order = self._param_order
        if args and order is not None and len(args) + len(kwargs) == len(order):
            named = dict(zip(order, args))
            if len(named) == len(args) and named.keys().isdisjoint(kwargs):
                kwargs = {**named, **kwargs}
                args = ()
        if not args and kwargs.keys() == self._keyword_names:
            if all(isinstance(v, torch.Tensor) for v in kwargs.values()):
                return kwargs
        if not args and kwargs.keys() == self._param_names:
            flat = _nested_leaves(kwargs)
            if flat is not None and flat.keys() == self._input_set:
                return flat
        leaves = named_leaves(bind_inputs(self.signature, args, kwargs))
        tensors = {n for n, v in leaves.items() if is_tensor(v)}
        missing = [n for n in self.input_names if n not in tensors]
        extra = sorted(tensors - set(self.input_names))
        not_tensors = [n for n in missing if n in leaves and leaves[n] is not None]
        if not_tensors:
            name = not_tensors[0]
            raise InputError(
                f"input {name!r} must be a torch.Tensor, got {type(leaves[name]).__name__}"
            )
        if missing:
            raise InputError(f"missing input(s): {', '.join(missing)}")
        if extra:
            raise InputError(
                f"unknown input(s): {', '.join(extra)}; expected: {', '.join(self.input_names)}"
            )
        for name, expected in self.constant_inputs.items():
            if name in leaves and not _same_constant(leaves[name], expected):
                raise InputError(
                    f"non-tensor input {name}={leaves[name]!r} differs from the value it had at "
                    f"compile time ({type(expected).__name__} {expected!r}); compile again for "
                    "another value"
                )
        return leaves

    def outputs(self, tensors: list[torch.Tensor]) -> Any:
        if self._single_output:
            return tensors[0]
        it = iter(tensors)
        flat = [next(it) if c is GRAPH_OUTPUT else c for c in self.out_constants]
        return pytree.tree_unflatten(flat, self.out_spec)


def _locator(signature: inspect.Signature, names: list[str]) -> Optional[tuple]:
    """``(parameter, its position or None, key or None)`` of the leaf ``names[0]``, a parameter or
    one key or field of one (``InputContract.first_rows``); None for any other leaf."""
    if not names:
        return None
    param, _, key = names[0].partition(".")
    if param not in signature.parameters or "." in key:
        return None
    kinds = [p.kind for p in signature.parameters.values()]
    position = list(signature.parameters).index(param)
    positional = all(k == inspect.Parameter.POSITIONAL_OR_KEYWORD for k in kinds[: position + 1])
    return param, position if positional else None, key or None


def _nested_leaves(kwargs: dict) -> Optional[dict]:
    """``named_leaves`` of keyword arguments that are tensors, str-keyed dicts of tensors or
    dataclasses of tensors (batch objects, named by field as pytree names them); None for any
    other structure (left to the general path)."""
    flat = {}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            flat[name] = value
            continue
        if type(value) is dict:
            items = value.items()
        else:
            fields = _tensor_fields(type(value))
            if fields is None:
                return None
            items = zip(fields, map(value.__getattribute__, fields))
        for key, leaf in items:
            if type(key) is not str or not isinstance(leaf, torch.Tensor):
                return None
            flat[f"{name}.{key}"] = leaf
    return flat


@functools.lru_cache(maxsize=256)
def _tensor_fields(cls: type) -> Optional[tuple[str, ...]]:
    """The fields pytree flattens of a dataclass registered as a pytree node; None for any
    other type."""
    if not dataclasses.is_dataclass(cls) or cls not in pytree.SUPPORTED_NODES:
        return None
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


def _same_constant(a: Any, b: Any) -> bool:
    try:  # ``2.0 == 2``, but the graph was traced with an int
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values count as different
        return False


class CompiledModel(nn.Module):
    """A model whose request-only computation runs once per request.

    Three layouts, each named by how it is called, never guessed from row counts:

    - ``cm(*args, **kwargs)``: drop-in, exactly the original call (replicated inputs); requests
      are found among consecutive equal request rows;
    - ``cm(*args, candidate_to_request=idx, **kwargs)``: shared layout, request inputs with one
      row per request (R rows), candidate inputs with N rows;
    - ``cm.call_replicated(*args, candidate_to_request=idx, **kwargs)``: replicated request inputs
      (N rows) with a known grouping; checks that they are constant within every request.

    ``candidate_to_request`` is the only keyword the compiled model takes for itself (a model
    input of that name is refused at compile time); every other keyword is the model's.

    ``weight_names`` maps the graph module's weight attributes to the parameter and buffer names
    of ``original``; with it the compiled model follows weight updates of ``original``.
    """

    def __init__(
        self,
        graph_module: Optional[fx.GraphModule],
        contract: InputContract,
        placeholder_of: dict[str, str],
        report_builder: Optional[Callable] = None,
        original: Optional[nn.Module] = None,
        fallback_reason: Optional[str] = None,
        weight_names: Optional[Mapping[str, str]] = None,
        plain: Optional[PlainProgram] = None,
        unit_flops: Optional[Callable[[], tuple[float, float]]] = None,
        input_format: Optional[InputFormat] = None,
        weights_from: Optional[nn.Module] = None,
        guards=NO_GUARDS,  # ``runtime/guards.py``: the model is still the one compiled
        recompile: Optional[Callable[[torch.dtype, torch.device], "CompiledModel"]] = None,
        training=None,  # ``runtime/training.py``: calls in grad mode run it under autograd
        eval_mode=None,  # ``runtime/eval_mode.py``: a training compile's calls in eval mode
    ):
        super().__init__()
        # Not a submodule (``_share_module_state``): its tensors are the program's aliases of the
        # original's weights, which no engine must see as the compiled model's own.
        object.__setattr__(self, "graph_module", graph_module)
        self.contract = contract
        self.placeholder_of = dict(placeholder_of)
        self._report_builder = report_builder
        self.fallback_reason = fallback_reason
        self._unit_flops_of = unit_flops
        if input_format is None:
            input_format = InputFormat(contract.signature, contract.request_inputs)
        self.input_format = input_format
        self._warned = False
        self._constant_outputs = constant_output_positions(graph_module)
        # A graph that computes nothing per request gains nothing from finding the requests of a
        # drop-in call: every candidate is taken as its own request (R = N, an identity index).
        self._request_work = _has_request_work(graph_module)
        self._weights_read = no_backward.weights_read_by_outputs(graph_module)
        batched = contract.batched if contract is not None else {}
        self._input_specs = InputSpecs.of_graph(graph_module, placeholder_of, batched)
        # Not a submodule either: a view of graph_module's tensors, rebuilt when they move or
        # when a weight refresh replaced one of them (a new ``_weights.epoch``).
        object.__setattr__(self, "_runner", None)
        object.__setattr__(self, "_runner_epoch", 0)
        # The captured graph unshared, and per call shape which of the two programs runs
        # (``runtime/program_choice.py``); None: always the shared program.
        if not isinstance(graph_module, fx.GraphModule):
            plain = None
        object.__setattr__(self, "_plain", plain)
        object.__setattr__(self, "_choice", ProgramChoice() if plain is not None else None)
        # Per bucket settled on the plain program, it or the original model (``original_arm.py``).
        arm = OriginalArm() if plain is not None and original is not None else None
        object.__setattr__(self, "_originals", arm)
        object.__setattr__(self, "_unit_flops", None)  # (per request, per candidate), on first use
        request_names = contract.request_inputs if contract is not None else ()
        self._request_set = frozenset(request_names)
        self._mislabel = MislabelWatch(request_names)  # names a varying request input
        weights = None
        if isinstance(graph_module, fx.GraphModule) and original is not None and weight_names:
            weights = WeightRefresh(graph_module, weights_from or original, weight_names)
        object.__setattr__(self, "_weights", weights)
        object.__setattr__(self, "_guards", guards)
        # Not a submodule: the compiled graph holds aliases of its weights and follows them.
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_weights_from", weights_from)
        # ``runtime/dtype_move.py``: the original compiled again for a move to another dtype.
        object.__setattr__(self, "_recompile", recompile)
        object.__setattr__(self, "_original_is_copy", False)  # a moved copy, after such a move
        object.__setattr__(self, "_training", training)
        object.__setattr__(self, "_module", original)  # the model this one stands for
        ddp = DDPWatch(original, self) if training is not None else None
        object.__setattr__(self, "_ddp", ddp)
        object.__setattr__(self, "_eval_mode", eval_mode)
        if original is not None:
            share_module_state(self, original)  # ``runtime/module_state.py``

    _cache = None  # a ``request_cache.CachedGraph`` when a request cache is attached
    _autocast = None  # ``runtime/autocast.py``: programs for calls under torch.autocast

    def __setattr__(self, name: str, value: Any) -> None:
        # The compiled model's own state stays its own; anything else (a parameter or submodule
        # assigned by the user) goes where nn.Module puts it: into the original's dicts.
        if name in self.__dict__ or name == "graph_module":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def train(self, mode: bool = True) -> "CompiledModel":
        """Switch the original model's mode (``cm.eval()``, a parent's ``.eval()``): the compiled
        model runs in its original's mode. A training compile in eval mode runs an inference
        compile of its original in eval mode (``runtime/eval_mode.py``); an inference compile
        switched to training mode is refused by the guards (docs/contract.md, "Autograd")."""
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        if self._module is not None:
            self._module.train(mode)
        object.__setattr__(self, "training", mode)
        return self

    @property
    def is_fallback(self) -> bool:
        return self.graph_module is None

    def report(self, candidates: int = 1024, requests: int = 1, **renamed):
        """Structured report: roles, FLOPs per request / per candidate, fallbacks, ideal speedup
        at ``requests`` requests of ``candidates`` candidates each, as ``rocs inspect
        --candidates N --requests R`` (built by the door that compiled the model; the runtime
        knows no report)."""
        if renamed:
            raise TypeError(
                f"report() got {', '.join(sorted(renamed))}=: it takes candidates= (per request, "
                "as `rocs inspect --candidates`) and requests=, e.g. "
                "cm.report(candidates=N // R, requests=R)"
            )
        if self._report_builder is None:
            raise RuntimeError("this compiled model was built without a report")
        report = self._mislabel.annotate(self._report_builder(candidates * requests, requests))
        return report if self._cache is None else self._cache.annotate(report)

    def cache_stats(self) -> Optional[dict]:
        """Hits, misses, evictions and bytes of the request cache (``runtime/request_cache.py``);
        None when the model has none."""
        return None if self._cache is None else self._cache.stats()

    def forward(self, *args, candidate_to_request: Optional[torch.Tensor] = None, **kwargs):
        eval_mode = self._eval_mode
        if eval_mode is not None and eval_mode.applies():  # a training compile in eval mode
            return eval_mode.call(self, args, kwargs, candidate_to_request)
        autocast = self._autocast
        if autocast is not None and autocast.active():  # ``runtime/autocast.py``
            return autocast.call("forward", args, kwargs, candidate_to_request)
        originals = self._originals
        if (
            originals is not None
            and originals.active
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        ):
            # Buckets that kept the original model (``runtime/original_arm.py``), before the
            # guards: a drop-in row class, or a shared-layout bucket of a call as made.
            if candidate_to_request is None:
                rows = self.contract.first_rows(args, kwargs)
                if rows is not None and rows.bit_length() in originals.dropin_originals:
                    return self._call_original(args, kwargs)
            elif originals.shared_originals and not self.input_format.converts:
                result = run_kept_original(self, args, kwargs, candidate_to_request)
                if result is not NOT_TAKEN:
                    return result
        if self.input_format.converts:
            return self._forward_format(args, kwargs, candidate_to_request, replicated=False)
        if originals is not None and originals.measuring_any() and self._choosing():
            result = run_as_original(self, args, kwargs, candidate_to_request)
            if result is not NOT_TAKEN:  # a trial: the plain program or the original model
                return result
        self._check_model()
        return self._forward_leaves(args, kwargs, candidate_to_request, self._choosing())

    def _check_model(self) -> None:
        """Before a call that runs a compiled program: the original model is still the one
        compiled (``runtime/guards.py``) and not wrapped by DDP since."""
        if not self._trains():  # a training call checks them where its program runs (``_train``)
            self._guards.check()
        elif self._ddp is not None:
            self._ddp.check()  # not past a DDP wrapping the original (``runtime/distributed.py``)

    def _trains(self) -> bool:
        """True when this call is a training call (``_run``): the training program or, where its
        bucket chose it, the original model itself, which needs no guards."""
        training = self._training
        return training is not None and (torch.is_grad_enabled() or training.writes_buffers)

    def _choosing(self) -> bool:
        """True when this call runs under the program choice (outside autograd and tracing)."""
        return (
            self._choice is not None
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        )

    def _forward_format(self, args: tuple, kwargs: dict, index, replicated: bool):
        """A call through a converting input format (``formats/``): the original model, when the
        format offers it and this call's bucket chose it, else the program on the converted
        call."""
        input_format = self.input_format
        choosing = self._choosing()  # a plain program, so a compiled graph
        offers = choosing and not replicated and input_format.offers_original
        if offers and index is None:
            sizes = input_format.original_sizes(args, kwargs)
            if sizes is not None and self._choice.decided(
                bucket(f"{sizes[0]}-original", sizes[1], sizes[2])
            ) == PLAIN:
                return self._call_original(args, kwargs)  # the call as made: no guards needed
        original = None
        if offers and self.graph_module is not None:
            original = input_format.original_program(self._original, args, kwargs, index)
            if original is not None:
                if original.index is not None and not index_trusted():
                    check_index_range(original.index, original.requests)
                key = bucket(f"{original.layout}-original", original.rows, original.requests)
                if self._choice.decided(key) == PLAIN:  # the original model: no guards needed
                    self._refresh_copy()
                    return original.run()
        if choosing and not replicated:
            # A bucket settled on the plain program, as called: the original model or, after
            # the guards, the plain program on the call's tensors.
            result = run_settled_as_called(self, args, kwargs, index)
            if result is not NOT_TAKEN:
                return result
        if not replicated:  # ``call_replicated`` checked them
            self._check_model()
        if self.graph_module is None:
            return self._run_original(args, kwargs, None if replicated else index)
        if original is not None:
            self._refresh_copy()
            return self._choice.run(
                key,
                lambda: self._program_call(
                    input_format.program_call(args, kwargs, index, False), False
                ),
                original.run,
                clock=self._trial_clock(original.index),
            )
        call = input_format.program_call(args, kwargs, index, replicated)
        return self._program_call(call, choosing)

    def _program_call(self, call: ProgramCall, choosing: bool):
        if call.layout == REPLICATED:
            return self._call_replicated(call.args, call.kwargs, call.index, choosing, call.given)
        return self._forward_leaves(
            call.args, call.kwargs, call.index, choosing, call.replicated, call.given
        )

    def _forward_leaves(
        self, args, kwargs, index, choosing: bool, replicated=frozenset(), as_called=None
    ):
        leaves = given = self.contract.leaves(args, kwargs)
        if as_called:  # the call's own tensors the plain program takes (``ProgramCall.given``)
            leaves = given = {**leaves, **as_called}
        if index is not None and not replicated:  # a bucket settled on the plain program
            if choosing:
                result = run_settled_plain(self, args, kwargs, leaves, index)
            elif self._trains() and self._chooses_training():
                result = run_settled_original(self, args, kwargs, leaves, index)
            else:
                result = NOT_TAKEN
            if result is not NOT_TAKEN:
                return result
        reducing = 0.0  # time spent reducing replicated request leaves: the shared program's
        if replicated and index is not None:
            if choosing and self._runs_as_given(given, index, replicated):
                return self._run_plain(given, None)
            clock = self._trial_clock(index)
            start = clock()
            leaves = self._reduce_leaves(leaves, index, replicated)
            reducing = clock() - start
        if choosing:
            if index is None:
                return self._dropin_choosing(args, kwargs, leaves)
            return self._shared_choosing(args, kwargs, leaves, index, given, reducing)
        uniform = None
        if index is None:
            if not replicated and self._trains_as_original(leaves):
                return self._original(*args, **kwargs)
            requests, index, uniform = self._group(leaves)
        else:
            requests, index = self._check_shared(leaves, index)
        return self._run(args, kwargs, leaves, requests, index, uniform)

    def _chooses_training(self) -> bool:
        """True when a training call (``_trains``) runs the program its bucket chose (``_train``):
        a training compile with the choice on, no converting input format, not being traced, not
        sharded by FSDP2 (whose ranks must run the same collectives: ``sharded_by_fsdp``)."""
        training = self._training
        return (
            training is not None
            and training.choice is not None
            and not self.input_format.converts
            and not torch.compiler.is_compiling()
            and not sharded_by_fsdp(self)
        )

    def _trains_as_original(self, leaves: dict) -> bool:
        """True for a drop-in training call whose row count's buckets all chose the original
        model (``_train``): it is called as made, without finding the requests first, which
        only the training program needs (a call whose request inputs require grad goes on to be
        refused by the program's path, whichever bucket it falls in)."""
        if not self._trains() or not self._chooses_training():
            return False
        rows = self._batch_rows(leaves, self.contract.batched_inputs)
        if self._training.choice.everywhere(bucket("train-dropin", rows)[:2]) != PLAIN:
            return False
        return not any(leaves[n].requires_grad for n in self.contract.request_inputs)

    def _runs_as_given(self, given: dict, index: Any, replicated: frozenset) -> bool:
        """True when a shared-layout call whose request inputs all come with one row per
        candidate (a packed input's request columns) falls in a bucket that runs the plain
        program: the program then takes the packed input as the original model does, and its
        answer is the original's on that input, so its request columns are not reduced nor
        checked constant per request (what the shared program needs)."""
        if any(n not in replicated for n in self.contract.request_inputs):
            return False
        self._check_index(given, index)
        num_candidates = index.shape[0]
        num_requests = check_index_range(index, num_candidates)
        return self._choice.decided(bucket("shared", num_candidates, num_requests)) == PLAIN

    def _shared_choosing(self, args, kwargs, leaves, index, given, reducing: float = 0.0):
        """A shared-layout call running the shared or the plain program, whichever its bucket
        chose (``runtime/program_choice.py``); every check of the shared layout runs first.
        ``given`` are the leaves as called: request leaves that came with one row per candidate
        (checked constant per request into ``leaves``, ``reducing`` seconds that only the shared
        program needs) are the plain program's as they are."""
        choice, contract = self._choice, self.contract
        first = contract.request_inputs[0] if contract.request_inputs else None
        rows = leaves[first].shape[0] if first is not None and leaves[first].dim() else 0
        num_candidates = index.shape[0] if is_tensor(index) and index.dim() else 0
        key = bucket("shared", num_candidates, rows)
        program = choice.decided(key)
        if program == PLAIN:  # a decided bucket is called directly: no closures per call
            return self._shared_plain(leaves, index, given)
        if program == SHARED:
            return self._run(args, kwargs, leaves, *self._check_shared(leaves, index))
        return choice.run(
            key,
            lambda: self._run(args, kwargs, leaves, *self._check_shared(leaves, index)),
            lambda: self._shared_plain(leaves, index, given),
            lambda: self._settle_if_clear(key, num_candidates, rows),
            shared_extra=reducing,
            margin=self._margin(num_candidates, rows),
            clock=self._trial_clock(index),
        )

    def _shared_plain(self, leaves: dict, index: torch.Tensor, given: dict):
        """A shared-layout call run by the plain program, after the layout's checks."""
        request_inputs = self.contract.request_inputs
        # The plain program's CPU gathers of request rows check the index's range.
        gathers = bool(request_inputs) and not leaves[request_inputs[0]].is_cuda
        self._check_shared(leaves, index, check_range=not gathers)
        return self._run_plain(leaves, index, given)

    def _dropin_choosing(self, args, kwargs, leaves):
        """A drop-in call under the program choice: the requests are found first (their number
        is part of the bucket) unless every bucket of this row count chose the plain program."""
        choice = self._choice
        rows = self._batch_rows(leaves, self.contract.batched_inputs)
        row_class = bucket("dropin", rows)[:2]
        if choice.everywhere(row_class) == PLAIN:
            return self._settled_dropin_plain(row_class + (0,), leaves)
        clock = self._trial_clock(leaves[self.contract.batched_inputs[0]])
        start = clock()
        requests, index, uniform = self._group(leaves)
        finding = clock() - start
        num_requests = next(iter(requests.values())).shape[0] if requests else rows
        key = bucket("dropin", rows, num_requests)
        program = choice.decided(key)
        if program is not None:
            return self._run_plain(leaves, None) if program == PLAIN else self._run(
                args, kwargs, leaves, requests, index, uniform
            )
        # Finding requests is the shared program's cost only while no bucket of the row count
        # shares; after that every call pays it (``runtime/program_choice.py``).
        alone = not choice.shares_in(row_class)
        return choice.run(
            key,
            lambda: self._run(args, kwargs, leaves, requests, index, uniform),
            lambda: self._run_plain(leaves, None),
            lambda: self._settle_if_clear(key, rows, num_requests),
            shared_extra=finding if alone else 0.0,
            margin=self._margin(rows, num_requests, DROPIN_MARGIN if alone else 0.0),
            clock=clock,
        )

    def _settled_dropin_plain(self, key: tuple, leaves: dict):
        """A drop-in call of a row class settled on the plain program: the plain program, its
        bucket noted for the measurement against the original model (``runtime/original_arm.py``,
        which runs a kept original before the guards); a converted call (``formats/``) is in the
        program's terms, not the original's."""
        arm = self._originals
        if arm is not None and not self.input_format.converts and self.contract.places_rows:
            arm.note(key)
        return self._run_plain(leaves, None)

    def _checked_call(self, args: tuple, kwargs: dict, index):
        """The call past the guards: what ``forward`` runs when no kept original takes it."""
        self._check_model()
        return self._forward_leaves(args, kwargs, index, True)

    def _call_original(self, args: tuple, kwargs: dict):
        """The original model on the call as made (a moved copy brought up to date first)."""
        if self._original_is_copy:
            self._refresh_copy()
        return self._original(*args, **kwargs)

    @staticmethod
    def _trial_clock(tensor: Any = None) -> Callable[[], float]:
        """The clock an inference trial is timed by (``program_choice.call_clock``): the thread's
        CPU time for a call whose ``tensor`` (an input) is on the CPU, with one torch thread;
        else, or without a tensor, wall time."""
        return call_clock(isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu")

    def _settle_if_clear(self, key: tuple, rows: int, num_requests: int) -> Optional[str]:
        """``SHARED`` (and the bucket settled) when, for ``rows`` candidates of ``num_requests``
        requests, the cost model's FLOP ideal reaches ``CLEAR_GAIN`` and the saving
        ``CLEAR_SAVING``; else None (measure). Inference calls only (``_train`` measures every
        bucket)."""
        shared, plain = self._flops(rows, num_requests)
        if shared <= 0 or plain < CLEAR_GAIN * shared or plain - shared < CLEAR_SAVING:
            return None
        self._choice.settle(key, SHARED)
        return SHARED

    def _margin(self, rows: int, num_requests: int, margin: float = 0.0) -> float:
        """The lead the shared program needs in a measured bucket (``margin_for``)."""
        shared, plain = self._flops(rows, num_requests)
        return margin_for(plain / shared if shared > 0 else 0.0, margin)

    def _flops(self, rows: int, num_requests: int) -> tuple[float, float]:
        """(shared, plain) FLOPs of a call, by the pipeline's counts; (0, 0) when unknown."""
        if self._unit_flops is None:
            object.__setattr__(self, "_unit_flops", self._flops_per_unit())
        per_request, per_candidate = self._unit_flops
        return num_requests * per_request + rows * per_candidate, rows * (per_request + per_candidate)

    def _flops_per_unit(self) -> tuple[float, float]:
        """(FLOPs per request, FLOPs per candidate), as the pipeline counted them; (0, 0), which
        settles nothing, when it gave none or cannot count them (a data-dependent graph)."""
        if self._unit_flops_of is None:
            return 0.0, 0.0
        try:
            return self._unit_flops_of()
        except Exception:  # noqa: BLE001 - the prior is optional: without it buckets are measured
            return 0.0, 0.0

    def _run_plain(self, leaves: dict, index: Optional[torch.Tensor], given=None):
        """The plain program on replicated inputs (gathered with ``index`` in the shared layout,
        unless ``given`` has them with one row per candidate already)."""
        if self._input_specs is not None:
            self._input_specs.check(leaves)
        names, request = self._plain.input_names or self.contract.input_names, self._request_set
        if index is None:
            inputs = [leaves[n] for n in names]
        else:
            source = leaves
            if given is not None and given is not leaves:
                request = {n for n in request if given[n] is leaves[n]}
                source = given
            try:
                inputs = [
                    source[n].index_select(0, index) if n in request else source[n] for n in names
                ]
            except IndexError:
                first = self.contract.request_inputs[0]
                check_index_range(index, leaves[first].shape[0])  # raises IndexRangeError
                raise
        return self.contract.outputs(self._plain(inputs))

    def program_choices(self) -> dict[tuple, str]:
        """Per call bucket ``(layout, rows bits, requests bits)``, the program it runs, ``"shared"``
        or ``"plain"``, for the buckets decided so far (training calls: layouts ``train-*``,
        ``"plain"`` being the original model; a training compile's calls in eval mode: layouts
        ``eval-*``, decided by its eval-mode program)."""
        choices = {} if self._choice is None else self._choice.decisions()
        training = self._training.choice if self._training is not None else None
        if training is not None:
            choices = {**choices, **training.decisions()}
        evaluating = self._eval_mode.program if self._eval_mode is not None else None
        if evaluating is not None:  # a training compile's eval-mode program: layouts ``eval-*``
            for (layout, *sizes), program in evaluating.program_choices().items():
                choices[(f"eval-{layout}", *sizes)] = program
        return choices

    def plain_runs(self) -> dict[tuple, str]:
        """Per bucket settled on the plain program (``program_choices``), what its calls run once
        measured: ``"plain program"`` or ``"original"``, the original model on the call as made
        (``runtime/original_arm.py``)."""
        return {} if self._originals is None else self._originals.decisions()

    def call_replicated(self, *args, candidate_to_request: torch.Tensor, **kwargs):
        """The original call (request inputs replicated, one row per candidate) with the
        grouping given: ``candidate_to_request[n]`` is candidate n's request. Raises
        :class:`InputError` when a request input varies within a request."""
        eval_mode = self._eval_mode
        if eval_mode is not None and eval_mode.applies():
            return eval_mode.call_replicated(self, args, kwargs, candidate_to_request)
        autocast = self._autocast
        if autocast is not None and autocast.active():
            return autocast.call("call_replicated", args, kwargs, candidate_to_request)
        self._guards.check()
        if self.input_format.converts:
            return self._forward_format(args, kwargs, candidate_to_request, replicated=True)
        return self._call_replicated(args, kwargs, candidate_to_request, self._choosing())

    def _call_replicated(self, args, kwargs, candidate_to_request, choosing: bool, as_called=None):
        leaves = self.contract.leaves(args, kwargs)
        if as_called:
            leaves = {**leaves, **as_called}
        requests, index = self._check_replicated(leaves, candidate_to_request)
        choice = self._choice
        if not choosing:
            return self._run(args, kwargs, leaves, requests, index)
        first = next(iter(requests.values()), None)
        num_requests = first.shape[0] if first is not None else 0
        key = bucket("replicated", index.shape[0], num_requests)
        return choice.run(
            key,
            lambda: self._run(args, kwargs, leaves, requests, index),
            lambda: self._run_plain(leaves, None),  # the replicated rows, as the model takes them
            lambda: self._settle_if_clear(key, index.shape[0], num_requests),
            margin=self._margin(index.shape[0], num_requests),
            clock=self._trial_clock(index),
        )

    def _run(self, args, kwargs, leaves, requests, index, uniform: Optional[int] = None):
        """Run the graph on ``leaves`` with the request inputs replaced by ``requests``
        (``requests is leaves`` in the shared layout); ``uniform`` is the number of requests when
        they are known to be equal-sized and contiguous (the kernels then group without a pass
        over ``index``)."""
        if self._input_specs is not None:
            self._input_specs.check(leaves)
        grad_mode = torch.is_grad_enabled()
        if self._trains():
            refuse_replicated_grads(leaves, requests)
            return self._train(args, kwargs, leaves, requests, index, uniform)
        if not grad_mode and self.graph_module is not None:
            # The common serving call (no_grad or inference mode): no autograd context to enter.
            with call_groups(index, uniform):
                if self._cache is None:
                    outputs = self._graph_runner()(*self._graph_inputs(leaves, requests), index)
                else:  # ``runtime/request_cache.py``
                    inputs = self._graph_inputs(leaves, requests)
                    outputs = self._cache.run(self, self._graph_runner(), inputs, index)
            if self._constant_outputs:
                outputs = self._clone_constants(outputs)
            return self.contract.outputs(outputs)
        if grad_mode:
            wants_grad = [n for n, v in leaves.items() if is_tensor(v) and v.requires_grad]
            if wants_grad:
                raise InputError(
                    f"input(s) {', '.join(wants_grad)} require grad, but a compiled model computes "
                    "without autograd (its outputs carry no gradient): call it under "
                    "torch.no_grad() or torch.inference_mode(), and train the original model"
                )
        if self.graph_module is None:
            with torch.no_grad():
                result = self._run_eager(args, kwargs, requests, index)
            return self._refuse_backward_eager(result) if grad_mode else result
        with torch.no_grad(), call_groups(index, uniform):
            inputs = self._graph_inputs(leaves, requests)
            outputs = self._clone_constants(self._graph_runner()(*inputs, index))
        if self._weights is not None:
            outputs = self._refuse_backward(outputs)
        return self.contract.outputs(outputs)

    def _train(self, args, kwargs, leaves, requests, index, uniform):
        """A training call: the training program, or the original model when this call's
        bucket chose it (``runtime/training.py``, "Program choice")."""
        training = self._training

        def program():
            if unshard_fsdp(self):  # ``runtime/distributed.py``
                training.look_up_again()
            self._guards.check()
            with call_groups(index, uniform):
                outputs = training(self._graph_inputs(leaves, requests), index)
            return self.contract.outputs(self._clone_constants(outputs))

        choice = training.choice
        if not self._chooses_training():
            return program()
        shared = requests is leaves
        first = self.contract.request_inputs[0] if self.contract.request_inputs else None
        num_requests = requests[first].shape[0] if first is not None else index.shape[0]
        key = bucket("train-shared" if shared else "train-dropin", index.shape[0], num_requests)

        def original():
            if not shared:  # drop-in and replicated calls: the original call as made
                return self._original(*args, **kwargs)
            gathered = {n: leaves[n].index_select(0, index) for n in self.contract.request_inputs}
            return call_with_rows(self, args, kwargs, gathered)

        decided = choice.decided(key)
        if decided is not None:
            return original() if decided == PLAIN else program()
        # Each trial is timed to the end of its backward (``runtime/step_timing.py``). No bucket
        # is settled by its FLOPs alone: a training program's fixed costs per op (the autograd
        # nodes of its fused ops, their backward's per-request sums) are not in the count, and
        # a step of a few hundred rows can share half its FLOPs and no time.
        return training.trials.run(
            key,
            program,
            original,
            lambda: None,
            margin=self._margin(index.shape[0], num_requests),
            clock=call_clock(index.device.type == "cpu"),
        )

    def _graph_inputs(self, leaves: dict, requests: dict) -> list:
        names = self.contract.input_names
        if requests is leaves:
            return [leaves[n] for n in names]
        return [requests[n] if n in requests else leaves[n] for n in names]

    def _clone_constants(self, outputs) -> list:
        """Never hand out the compiled model's own buffers."""
        outputs = list(outputs)
        for i in self._constant_outputs:
            outputs[i] = outputs[i].clone()
        return outputs

    def _refuse_backward(self, outputs: list) -> list:
        """In grad mode, outputs eager would attach to a weight requiring grad get a ``grad_fn``
        that raises on backward (``runtime/no_backward.py``)."""
        weights, reads = self._weights, self._weights_read
        anchor = weights.requiring_grad()
        if anchor is None:
            return outputs
        if reads is None or len(reads) != len(outputs):
            wants = [True] * len(outputs)
        else:
            wants = [weights.requiring_grad(r) is not None for r in reads]
        return no_backward.attach(outputs, wants, anchor)

    def _refuse_backward_eager(self, result):
        anchor = no_backward.first_requiring_grad(self._original.parameters())
        if anchor is None:
            return result
        leaves, spec = pytree.tree_flatten(result)
        leaves = no_backward.attach(leaves, [True] * len(leaves), anchor)
        return pytree.tree_unflatten(leaves, spec)

    def __deepcopy__(self, memo: dict) -> "CompiledModel":
        """Its original model deep-copied (through ``memo``: a parent copied with both holds one
        copy of the model) and compiled again with the same arguments (``api.py``)."""
        again = self.__dict__.get("_compile_copy")
        if again is None:
            raise CompileError(
                "this compiled model cannot be deep-copied (it was not made by rocs.compile): "
                "compile a deep copy of its model instead"
            )
        memo[id(self)] = copied = again(memo)
        return copied

    def with_graph(self, graph: nn.Module) -> "CompiledModel":
        """A compiled model with this one's contract and report that runs ``graph`` instead
        (e.g. the graph lowered by Inductor): a module taking the graph module's inputs, whose
        ``graph`` attribute is the FX graph it computes."""
        compiled = CompiledModel(
            graph, self.contract, self.placeholder_of, self._report_builder, self._original,
            unit_flops=self._unit_flops_of, input_format=self.input_format,
        )  # fmt: skip
        object.__setattr__(compiled, "_weights", self._weights)  # the same graph module's weights
        object.__setattr__(compiled, "_guards", self._guards)
        compiled._weights_read = self._weights_read
        compiled._input_specs = self._input_specs
        return compiled

    def refresh_weights(self) -> None:
        """Re-read every weight of the original model and evaluate every folded constant again.

        Calls do this by themselves after in-place updates and reassignments; only writes
        through ``.data``, which bypass PyTorch's version counters, need it.
        """
        if self._weights is not None:
            self._weights.refresh(force=True)

    def current_graph(self) -> Optional[nn.Module]:
        """The rewritten graph as the next call would run it, for readers of the graph itself
        (``rocs.export``): the guards' check that the original is still the model compiled
        (``runtime/guards.py``), then its weights and folded constants brought up to date."""
        self._guards.check()
        if self._weights is not None:
            self._weights.refresh()  # returns at once when no weight moved
        return self.graph_module

    def _graph_runner(self) -> Callable:
        """The graph with its ops called directly: ``index`` was range-checked above."""
        if torch.compiler.is_compiling():
            return self.graph_module  # tracers (dynamo, export) read the graph's ops themselves
        weights = self._weights
        epoch = 0
        if weights is not None:
            if not weights.current():
                weights.refresh()
            epoch = weights.epoch
        if self._runner is None or self._runner_epoch != epoch:
            from .direct import direct_program

            gm = self.graph_module
            runner = direct_program(gm) if isinstance(gm, fx.GraphModule) else gm
            object.__setattr__(self, "_runner", runner)
            object.__setattr__(self, "_runner_epoch", epoch)
        return self._runner

    def _apply(self, fn, recurse=True):
        fn = keep_integer_dtypes(fn)  # ``cm.type(dtype)`` moves floating tensors only
        if self._eval_mode is not None:
            self._eval_mode.moved(fn)
        if self._autocast is not None:
            self._autocast.moved(fn)
        if self._recompile is not None:
            held = self._weights.held() if self._weights is not None else []
            inputs = self._input_specs.empty_tensors() if self._input_specs is not None else []
            target = dtype_move(fn, held + inputs)
            if target is not None:  # compiled again for the new dtype
                self._adopt(self._recompile(*target), target)
                return self
        # ``.to()`` and friends may replace the graph's buffers: rebuild the runner on next call,
        # and find out again which weights still alias the original's. The original's own
        # tensors (the compiled model's parameters) stay as they are.
        object.__setattr__(self, "_runner", None)
        if isinstance(self.graph_module, nn.Module):
            self.graph_module._apply(fn, recurse)
        if self._plain is not None:
            self._plain.moved(fn)
        if self._input_specs is not None:
            self._input_specs = self._input_specs.moved(fn)
        if self._weights is not None:
            self._weights.bind()
        return self

    def _adopt(self, new: "CompiledModel", moved_to: tuple) -> None:
        """Run ``new``'s programs (compiled from a moved copy of the original, which its eager
        paths run), still guarding the original and following its weights, as cast copies."""
        base = self._weights_from if self._weights_from is not None else self._original
        for name, value in vars(new).items():
            if name not in _MODULE_STATE and name not in _KEPT_ON_MOVE:
                object.__setattr__(self, name, value)
        self.graph_module = new.graph_module
        if new._weights is not None:
            object.__setattr__(self, "_weights", new._weights.following(base))
        if self._plain is not None:
            self._plain.follow(base)
        if new._training is not None:  # the training program reads the original, cast
            object.__setattr__(self, "_training", new._training.following(base, *moved_to))
        object.__setattr__(self, "_original_is_copy", True)

    def _refresh_copy(self) -> None:
        """Before the eager model runs: a moved copy's weights are the graph's cast copies of
        the original's, brought up to date by a refresh."""
        weights = self._weights
        if self._original_is_copy and weights is not None and not weights.current():
            weights.refresh()

    # -- conventions ---------------------------------------------------------------------------

    def _batch_rows(self, leaves: dict, names: list[str]) -> int:
        if len(names) == 1 and leaves[names[0]].dim():
            return leaves[names[0]].shape[0]
        rows = [leaves[n].shape[0] if leaves[n].dim() else None for n in names]
        first = rows[0]
        if first is None or rows.count(first) != len(rows):
            raise row_count_error(dict(zip(names, rows)), self._request_set)
        return first

    def _group(self, leaves: dict):
        if torch.compiler.is_compiling():  # ``torch.compile(cm)``: dynamo stops at the grouping
            return _group_untraced(self, leaves)
        return self._group_rows(leaves)

    def _group_rows(self, leaves: dict):
        contract = self.contract
        rows = self._batch_rows(leaves, contract.batched_inputs)
        if not self._request_work:
            device = leaves[contract.batched_inputs[0]].device
            return leaves, torch.arange(rows, device=device), rows
        request_leaves = [leaves[n] for n in contract.request_inputs]
        if request_leaves and request_leaves[0].is_meta:
            raise InputError(
                "inputs on the meta device have no values to find requests by; call the compiled "
                "model with tensors on the device it was compiled for"
            )
        found = detect_requests(request_leaves, rows)
        self._mislabel.observe(leaves, found.counts, rows)
        counts = found.counts
        if counts and counts.count(counts[0]) == len(counts):
            # Equal-sized requests: the first row of each is every counts[0]-th row, a view
            # (equal to gathering the starts), and the grouping is known.
            requests = {n: leaves[n][:: counts[0]] for n in contract.request_inputs}
            return requests, found.index, len(counts)
        requests = {n: leaves[n].index_select(0, found.starts) for n in contract.request_inputs}
        return requests, found.index, None

    def _check_index(self, leaves: dict, index: Any) -> None:
        """Check ``index`` against the candidate inputs (type, length, device)."""
        contract = self.contract
        candidates = contract.candidate_inputs
        rows = self._batch_rows(leaves, candidates) if candidates else None
        batched = candidates or contract.request_inputs
        device = leaves[batched[0]].device if batched else None
        check_candidate_to_request(index, rows, None, device=device)

    def _check_shared(self, leaves: dict, index: Any, check_range: bool = True):
        """Check a shared-layout call; ``check_range=False`` leaves the range of ``index`` to
        its consumer (the plain program's CPU gathers, which check it)."""
        contract = self.contract
        self._check_index(leaves, index)
        num_candidates = index.shape[0]
        if contract.request_inputs:
            num_requests = self._batch_rows(leaves, contract.request_inputs)
        else:
            num_requests = num_candidates
        if index_trusted():
            return leaves, index
        if check_range:
            check_index_range(index, num_requests)
        if contract.request_inputs and num_requests == num_candidates > 1:
            # One row per candidate is what replicated inputs look like: accept it only when
            # every row is its own request (the index is a permutation), never reinterpret it.
            if distinct_values(index) != num_candidates:
                raise InputError(
                    f"request inputs have {num_requests} rows, one per candidate, but "
                    "candidate_to_request groups candidates into fewer requests: the shared "
                    "layout takes one row per request. For replicated request inputs call the "
                    "model without candidate_to_request, or cm.call_replicated(...)"
                )
        return leaves, index

    def _reduce_leaves(self, leaves: dict, index: Any, replicated: frozenset) -> dict:
        """A shared-layout call whose request leaves ``replicated`` come with one row per
        candidate (a packed input's request columns): each checked constant within every
        request and kept at one row per request."""
        self._check_index(leaves, index)
        others = [n for n in self.contract.request_inputs if n not in replicated]
        num_candidates = index.shape[0]
        if others:
            num_requests = self._batch_rows(leaves, others)
            check_index_range(index, num_requests)
        else:  # the requests are those the index reaches
            num_requests = check_index_range(index, num_candidates)
        leaves = dict(leaves)
        for name in replicated:
            value = leaves[name]
            if value.shape[0] != num_candidates:
                raise InputError(
                    f"input {name!r} has {value.shape[0]} rows; candidate_to_request has "
                    f"{num_candidates} entries, one per row of the packed input"
                )
            leaves[name] = _reduce_replicated(name, value, index, num_requests)
        return leaves

    def _check_replicated(self, leaves: dict, index: Any):
        contract = self.contract
        self._check_index(leaves, index)
        num_candidates = index.shape[0]
        num_requests = check_index_range(index, num_candidates)
        requests = {}
        for name in contract.request_inputs:
            value = leaves[name]
            rows = value.shape[0] if value.dim() else None
            if rows != num_candidates:
                raise InputError(
                    f"call_replicated takes request inputs with one row per candidate; "
                    f"{name!r} has {rows} rows, candidate_to_request {num_candidates} entries"
                )
            requests[name] = _reduce_replicated(name, value, index, num_requests)
        return requests, index

    def _run_original(self, args: tuple, kwargs: dict, index):
        """The eager fallback of a converting format: the original model on the user's call."""
        self._warn_fallback()
        grad_mode = torch.is_grad_enabled()
        with torch.no_grad():
            result = self.input_format.run_original(self._original, args, kwargs, index)
        return self._refuse_backward_eager(result) if grad_mode else result

    def _warn_fallback(self) -> None:
        if not self._warned:
            warnings.warn(
                f"rocs: running the original model eagerly ({self.fallback_reason})", stacklevel=4
            )
            self._warned = True

    def _run_eager(self, args, kwargs, requests, index):
        self._warn_fallback()
        gathered = {n: requests[n].index_select(0, index) for n in self.contract.request_inputs}
        call_args, call_kwargs = replace_leaves(self.contract.signature, args, kwargs, gathered)
        return self._original(*call_args, **call_kwargs)


# Outside dynamo's trace: the grouping reads rows as bytes through dtype views, whose aliases
# AOTAutograd regenerates with the wrong itemsize, and its Python counts would guard (and
# recompile) on every batch's request sizes. Eager calls skip the wrapper's cost (about 1 us).
_group_untraced = torch.compiler.disable(CompiledModel._group_rows)

# What ``_adopt`` leaves as it is: nn.Module's own state, and what watches the original.
_MODULE_STATE = frozenset(vars(nn.Module()))
_KEPT_ON_MOVE = frozenset(
    {"_guards", "_weights_from", "_recompile", "_module", "_eval_mode", "_autocast"}
)


def _has_request_work(graph_module: Optional[nn.Module]) -> bool:
    """True unless ``graph_module`` is a graph none of whose ops is placed per request."""
    graph = getattr(graph_module, "graph", None)
    if not isinstance(graph, fx.Graph):
        return True
    return any(n.op == "call_function" and n.meta.get(PLACEMENT) == Role.REQUEST for n in graph.nodes)


def _reduce_replicated(name: str, value: torch.Tensor, index: torch.Tensor, num_requests: int):
    shared, consistent = reduce_rows(value, index, num_requests)
    if not consistent:
        raise InputError(f"request input {name!r} varies within a request")
    return shared
