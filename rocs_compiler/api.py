"""``rocs.compile``: the library entry point."""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Optional, Sequence

from torch import nn

from .formats import columns as column_lanes, kjt as kjt_lanes
from .errors import CompileError
from .options import Options
from .pipeline import compile_graph
from .runtime import CompiledModel, InputContract
from .runtime.guards import Guards


def compile(  # noqa: A001 - mirrors torch.compile
    model: nn.Module,
    request_inputs: Sequence[str] | str,
    example_inputs: Sequence[Any] = (),
    example_kwargs: Optional[Mapping[str, Any]] = None,
    *,
    fallback: str = "error",
    options: Optional[Mapping[str, Any] | Options] = None,
    unbatched_inputs: Sequence[str] | str = (),
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
    """
    options = Options.from_mapping(options, where="rocs.compile")
    if isinstance(request_inputs, str):
        request_inputs = [request_inputs]
    if kjt_lanes.takes_kjt(model, example_inputs, example_kwargs or {}):
        return kjt_lanes.compile_kjt(
            compile, model, request_inputs, example_inputs, example_kwargs or {},
            fallback=fallback, options=options, unbatched_inputs=unbatched_inputs,
        )  # fmt: skip
    ranges, plain = column_lanes.parse(request_inputs)
    if ranges:
        return column_lanes.compile_columns(
            compile, model, ranges, plain, example_inputs, example_kwargs or {},
            fallback=fallback, options=options, unbatched_inputs=unbatched_inputs,
        )  # fmt: skip
    if fallback not in ("error", "eager"):
        raise ValueError(f"fallback must be 'error' or 'eager', got {fallback!r}")
    example_kwargs = dict(example_kwargs or {})
    if isinstance(unbatched_inputs, str):
        unbatched_inputs = [unbatched_inputs]
    unbatched = list(unbatched_inputs)
    try:
        result = compile_graph(
            model, list(request_inputs), tuple(example_inputs), example_kwargs, options, unbatched
        )
    except CompileError as err:
        if fallback == "error":
            raise
        return _eager_fallback(
            model, list(request_inputs), tuple(example_inputs), example_kwargs, err, unbatched
        )
    captured = result.captured
    contract = _contract(captured)
    def report_builder(num_candidates: int, num_requests: int):
        from .report.build import build_report

        return build_report(result, num_candidates, num_requests, model)

    plain = None
    if options.autotune:
        from .pipeline import plain_graph
        from .runtime.plain import PlainProgram

        plain = PlainProgram(plain_graph(result), model, captured.param_names)
    compiled = CompiledModel(
        result.shared_graph, contract, captured.placeholder_of, report_builder, model,
        weight_names=captured.param_names, plain=plain,
        guards=Guards(model, captured.reads, captured.param_names),
    )
    compiled.pipeline_result = result  # logical and shared graphs, for inspection tools
    return compiled


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


def _eager_fallback(model, request_inputs, example_args, example_kwargs, err, unbatched) -> CompiledModel:
    from .capture.trace import describe_example

    warnings.warn(f"rocs: compilation failed, the model will run eagerly: {err}", stacklevel=3)
    call = describe_example(model, example_args, example_kwargs, request_inputs, unbatched)
    return CompiledModel(None, _contract(call), {}, None, model, fallback_reason=str(err).splitlines()[0])
