"""``rocs.compile``: the library entry point."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from .capture.failure import without_eager_advice
from .capture.marked_example import MarkedExample
from .capture.trace import describe_example
from .errors import CompileError
from .formats.base import Prepared
from .formats.select import prepare
from .options import Options
from .pipeline import compile_graph, plain_graph
from .runtime import CompiledModel, InputContract
from .runtime.modes.autocast import AutocastPrograms, under_autocast
from .runtime.training.distributed import refuse_sharded, refuse_wrapped
from .runtime.modes.eval_mode import EvalMode
from .runtime.modes.new_sizes import SizeGrowth
from .runtime.follow.guards import Guards
from .runtime.follow.mislabel import example_finding
from .runtime.follow.nesting import NestingParameters
from .runtime.call.jagged import jagged_calls
from .runtime.call.nested_histories import padded_example
from .runtime.call.plain import PlainProgram
from .runtime.training.program import TrainingProgram, draws_per_request, warn_random_fallbacks
from .runtime.cache.request_cache import RequestCache
from .runtime.cache.request_cache import attach as attach_cache


def compile(  # noqa: A001 - mirrors torch.compile
    model: nn.Module,
    request_inputs: Sequence[str] | str,
    example_inputs: Sequence[Any] = (),
    example_kwargs: Optional[Mapping[str, Any]] = None,
    *,
    fallback: str = "error",
    options: Optional[Mapping[str, Any] | Options] = None,
    unbatched_inputs: Sequence[str] | str = (),
    training: bool = False,
    request_cache: Optional[RequestCache] = None,
) -> CompiledModel:
    """Compile ``model`` so its request-only computation runs once per request.

    Args:
        model: an ``nn.Module`` in eval mode, written for replicated inputs.
        request_inputs: names of the request-side inputs (argument names, or dotted
            ``"arg.key"`` names for tensors inside dicts or lists), or column ranges of a 2-D
            argument, ``"X[:, 0:12]"`` (features packed into one tensor, as DeepCTR does), or
            keys of a TorchRec ``KeyedJaggedTensor`` argument, ``"sparse_features[user_id]"``.
        example_inputs, example_kwargs: one example batch in replicated layout.
        fallback: ``"error"`` raises :class:`CompileError` when the model cannot be captured;
            ``"eager"`` returns a wrapper that runs the original model and warns once.
        options: pass switches, a dict or :class:`Options`, e.g. ``{"defer": False}``; an
            unknown key or a wrong type raises :class:`OptionsError` listing the valid ones.
        unbatched_inputs: names of tensor inputs without a batch dim (a table passed to every
            call), needed only when their dim 0 equals the example's batch size.
        training: compile for training (the option ``training``): the model may be in training
            mode (captured as it is), and calls in grad mode backpropagate into the model's own
            parameters, with the request side computed once per request forward and backward
            (docs/contract.md, "Autograd").
        request_cache: a :class:`rocs.RequestCache` keeping the request side's values of recent
            requests across calls (``docs/contract.md``, "Request cache"); one per model.
    """
    options = Options.from_mapping(options, where="rocs.compile")
    if training:
        options = dataclasses.replace(options, training=True)
    if options.training and fallback == "eager":
        raise ValueError(
            "fallback='eager' does not combine with training=True: train the original model"
        )
    if fallback not in ("error", "eager"):
        raise ValueError(f"fallback must be 'error' or 'eager', got {fallback!r}")
    if isinstance(request_inputs, str):
        request_inputs = [request_inputs]
    if isinstance(unbatched_inputs, str):
        unbatched_inputs = [unbatched_inputs]
    unbatched = list(unbatched_inputs)
    if torch.distributed.is_available():
        refuse_wrapped(model)  # DDP: wrap the compiled model (``runtime/training/distributed.py``)
        refuse_sharded(model)  # FSDP2: shard after compiling
    example_kwargs = padded_example(example_kwargs)  # nested histories: padded, length dynamic
    example = MarkedExample(example_inputs, example_kwargs or {})  # before capture consumes marks
    prepared = prepare(model, request_inputs, example_inputs, example_kwargs or {})

    def _again(memo: dict) -> CompiledModel:  # ``copy.deepcopy(compiled)``
        cache = request_cache
        if cache is not None:  # a fresh one of the same size: a cache serves one model
            cache = RequestCache(cache.max_bytes, autotune=cache.autotune)
        return compile(
            copy.deepcopy(model, memo), request_inputs,
            *example.copy(lambda tensor: copy.deepcopy(tensor, memo)), fallback=fallback,
            options=options, unbatched_inputs=unbatched, request_cache=cache,
        )  # fmt: skip

    try:
        if prepared.failure is not None:
            raise prepared.failure
        result = compile_graph(
            prepared.model, prepared.request_inputs, prepared.args, prepared.kwargs, options,
            unbatched,
        )  # fmt: skip
    except CompileError as err:
        if fallback == "error":
            raise
        return _copyable(_eager_fallback(model, prepared, err, unbatched), _again)
    captured = result.captured
    # Through the wrapper a format compiled (its stand-ins translated back): the user's model.
    watched, reads, weight_names = prepared.watched(model, captured.reads, captured.param_names)
    plain = None
    if options.autotune and not options.training:
        # The format's plain graph takes what it can of the call as given (a packed input whole).
        gm, names = prepared.format.plain_graph(plain_graph(result), captured.input_names)
        plain = PlainProgram(gm, watched, weight_names, names, captured.batched)

    def report_builder(num_candidates: int, num_requests: int, lengths=None):
        from .report.build import build_report

        return build_report(result, num_candidates, num_requests, prepared.model, lengths)

    compiled = CompiledModel(
        result.shared_graph, _contract(captured), captured.placeholder_of, report_builder, model,
        weight_names=weight_names, plain=plain, unit_flops=result.unit_flops,
        input_format=prepared.format, weights_from=watched,
        guards=Guards(watched, reads, weight_names),
        recompile=_recompiler(model, request_inputs, example, options, unbatched),
        training=_training_program(result, prepared.model, options) if options.training else None,
        eval_mode=_eval_mode(model, request_inputs, example, options, unbatched),
        nesting=_nesting(prepared.model, captured.nested_fast_path_params),
    )  # fmt: skip
    autocast = _autocast_programs(model, request_inputs, example, options, unbatched)
    object.__setattr__(compiled, "_autocast", autocast)
    if request_cache is not None:
        attach_cache(compiled, request_cache)
    compiled.pipeline_result = result  # logical and shared graphs, for inspection tools
    if options.jagged:
        jagged, refused = jagged_calls(result, compiled.contract)
        if jagged is not None:
            jagged.converted = prepared.format.converts
        object.__setattr__(compiled, "_jagged", jagged)
        object.__setattr__(compiled, "jagged_refused", refused)
    if not prepared.format.converts:  # a format converting its inputs marks its own lengths
        object.__setattr__(compiled, "_growth", _size_growth(
            model, request_inputs, example, options, unbatched, compiled.contract
        ))  # fmt: skip
    compiled._mislabel.finding = example_finding(compiled.contract, prepared.args, prepared.kwargs)
    return _copyable(compiled, _again)


def _copyable(compiled: CompiledModel, again) -> CompiledModel:
    """``compiled`` deep-copies as its model deep-copied and compiled again with the same
    arguments (``CompiledModel.__deepcopy__``): the copy owns a copy of the weights, as a deep
    copy of the model does."""
    object.__setattr__(compiled, "_compile_copy", again)
    return compiled


def _recompiler(model, request_inputs, example: MarkedExample, options, unbatched):
    """``recompile(dtype, device)``: ``model`` compiled again as moved there, on the example moved
    the same way, with the same options; what a compiled model's move to another floating dtype
    runs (``runtime/follow/dtype_move.py``)."""

    def recompile(dtype: torch.dtype, device: torch.device) -> CompiledModel:
        how = f"compile the model in that dtype yourself: rocs.compile(model.to({dtype}), ...)"
        try:
            moved = copy.deepcopy(model).to(device, dtype)
        except Exception as err:  # noqa: BLE001 - any failure to copy: say what to do instead
            raise CompileError(
                f"moving a compiled model to {dtype} compiles a copy of its model in {dtype}, "
                f"and the model could not be copied ({type(err).__name__}: {err}); {how}"
            ) from err

        def convert(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, dtype) if t.is_floating_point() else t.to(device)

        args, kwargs = example.copy(convert)
        try:
            return compile(
                moved, request_inputs, args, kwargs, options=options, unbatched_inputs=unbatched
            )
        except CompileError as err:
            raise CompileError(
                f"moving a compiled model to {dtype} compiles its model again in {dtype}, which "
                f"failed: {err}"
            ) from err

    return recompile


def _size_growth(model, request_inputs, example: MarkedExample, options, unbatched, contract):
    """For a call at sizes past the batch dim that the example did not have
    (``runtime/modes/new_sizes.py``): ``model`` compiled again on a copy of the example with those
    dims marked dynamic besides the ones it marked, with the same options."""

    def compile_marked(dims: Mapping[str, tuple[int, ...]]) -> CompiledModel:
        args, kwargs = example.copy()
        leaves = contract.leaves(args, kwargs)
        for name, marked in dims.items():
            for dim in marked:
                torch._dynamo.mark_dynamic(leaves[name], dim)
        try:
            return compile(
                model, request_inputs, args, kwargs, options=options, unbatched_inputs=unbatched
            )
        except CompileError as err:  # its first line: where the model fixes the size, and how
            lines = without_eager_advice(str(err)).strip().splitlines()
            raise CompileError(lines[0] if lines else type(err).__name__) from err

    return SizeGrowth(compile_marked)


def _autocast_programs(model, request_inputs, example: MarkedExample, options, unbatched):
    """For calls under ``torch.autocast`` (``runtime/modes/autocast.py``): ``model`` wrapped in that
    autocast, compiled on the same example with the same options, on first use."""

    def compile_under(device_type: str, dtype: torch.dtype) -> CompiledModel:
        return _compile_again(
            under_autocast(model, device_type, dtype), request_inputs, example, options, unbatched,
            f"a call under torch.autocast({device_type!r}, dtype={dtype}) runs the model "
            "compiled under that autocast",
            "; call it outside autocast, or compile the model without rocs",
        )  # fmt: skip

    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    return AutocastPrograms(compile_under, device)


def _eval_mode(model, request_inputs, example: MarkedExample, options, unbatched):
    """For a training compile of a model in training mode, its calls in eval mode
    (``runtime/modes/eval_mode.py``): ``model`` compiled for inference as it is then, on the same
    example, with the same options; None otherwise."""
    if not options.training or not model.training:
        return None
    inference = dataclasses.replace(options, training=False)

    def compile_eval() -> CompiledModel:
        return _compile_again(
            model, request_inputs, example, inference, unbatched,
            "a training compile in eval mode runs its model compiled for inference in eval "
            "mode, rocs.compile(model.eval(), ...)",
        )  # fmt: skip

    return EvalMode(model, compile_eval)


def _compile_again(
    model, request_inputs, example: MarkedExample, options, unbatched, why, then=""
) -> CompiledModel:
    """``model`` compiled on the compile's own example and options, for a call that needs another
    program of it; a failure is a ``CompileError`` saying ``why`` that program runs."""
    try:
        return compile(
            model, request_inputs, *example.copy(), options=options, unbatched_inputs=unbatched
        )
    except (CompileError, ValueError) as err:
        raise CompileError(f"{why}, which failed: {err}{then}") from err


def _training_program(result, model: nn.Module, options: Options) -> TrainingProgram:
    captured = result.captured
    # A program drawing dropout per request computes another model than the original: no
    # choice between the two.
    choose = options.autotune and not draws_per_request(result.shared_graph)
    warn_random_fallbacks(result.analysis.fallbacks, options.request_dropout == "per_request")
    return TrainingProgram(
        result.shared_graph, model, captured.param_names, captured.buffer_writes, choose
    )



def _nesting(model: nn.Module, names: list[str]) -> Optional[NestingParameters]:
    """What a call reads to decide an encoder's nested fast path (``kernels/nested_padding.py``);
    None for a model none of whose encoders nests, whose calls then skip the decision."""
    return NestingParameters(model, names) if names else None


def _contract(described) -> InputContract:
    """The runtime contract of a :class:`CapturedGraph` or an :class:`ExampleCall`."""
    return InputContract(
        described.signature,
        described.input_names,
        described.request_inputs,
        described.batched,
        described.constant_inputs,
        described.out_spec,
        described.out_constants,
    )


def _eager_fallback(model, prepared: Prepared, err: CompileError, unbatched) -> CompiledModel:
    """The original model behind the compiled model's interface, warning once."""
    message = without_eager_advice(str(err))
    warnings.warn(
        f'rocs: compilation failed, the model will run eagerly (fallback="eager"): {message}',
        stacklevel=3,
    )
    reason = message.splitlines()[0] if message else type(err).__name__
    contract = None
    if not prepared.format.converts:
        call = describe_example(
            model, prepared.args, prepared.kwargs, prepared.request_inputs, unbatched
        )
        contract = _contract(call)

    def report_builder(num_candidates: int, num_requests: int, lengths=None):
        from .report.build import Report

        return Report.for_fallback(reason)

    return CompiledModel(
        None, contract, {}, report_builder, model, fallback_reason=reason,
        input_format=prepared.format,
    )  # fmt: skip
