"""CompiledModel: the public face of a compiled model, an ``nn.Module`` that stands for its
original.

Two calling conventions:

- shared layout: request inputs with R rows, candidate inputs with N rows, and
  ``candidate_to_request`` (int64 [N], values in [0, R));
- drop-in: the original call with replicated inputs; consecutive rows with equal request inputs
  form one request.

The face holds the module surface (forward, train/eval, parameters, ``_apply``, deepcopy,
report, cache stats, weight refresh) and delegates each call to the call path
(``runtime/call/path.py``: format, contract, checks, choice, lane). The module holds no per-call
state, so concurrent calls are safe; it has no shape specialization, so any R and N run without
recompiling. It computes with the original model's current weights: in-place updates and
reassigned parameters are seen (``runtime/follow/weights.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
from torch import fx, nn

from ..errors import CompileError
from ..formats.base import InputFormat
from .call import lanes, path
from .call.contract import InputContract
from .call.grouping import has_request_work
from .call.jagged import jagged_summary
from .call.input_checks import InputSpecs
from .call.lengths import LengthDims
from .call.original_arm import OriginalArm
from .call.plain import PlainProgram, constant_output_positions
from .choice.program_choice import ProgramChoice
from .follow import moves
from .follow.guards import NO_GUARDS
from .follow.mislabel import MislabelWatch
from .follow.module_state import share_module_state
from .follow.weights import WeightRefresh
from .training import no_backward
from .training.distributed import DDPWatch

__all__ = ["CompiledModel", "InputContract"]


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
        unit_flops: Optional[Callable[..., tuple[float, float]]] = None,  # ``prior.py``
        input_format: Optional[InputFormat] = None,
        weights_from: Optional[nn.Module] = None,
        guards=NO_GUARDS,  # ``runtime/follow/guards.py``: the model is still the one compiled
        recompile: Optional[Callable[[torch.dtype, torch.device], "CompiledModel"]] = None,
        training=None,  # ``runtime/training/training.py``: calls in grad mode run it under autograd
        eval_mode=None,  # ``runtime/modes/eval_mode.py``: a training compile's calls in eval mode
        nesting=None,  # ``runtime/follow/nesting.py``: parameters an encoder's fast path reads
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
        self._request_work = has_request_work(graph_module)
        self._weights_read = no_backward.weights_read_by_outputs(graph_module)
        batched = contract.batched if contract is not None else {}
        self._input_specs = InputSpecs.of_graph(graph_module, placeholder_of, batched)
        # Where a call's dynamic lengths are read, for its bucket's length class; None: no
        # dynamic length, nothing read per call (``runtime/call/lengths.py``).
        input_names = contract.input_names if contract is not None else ()
        object.__setattr__(self, "_lengths", LengthDims.of_specs(self._input_specs, input_names))
        # Not a submodule either: a view of graph_module's tensors, rebuilt when they move or
        # when a weight refresh replaced one of them (a new ``_weights.epoch``).
        object.__setattr__(self, "_runner", None)
        object.__setattr__(self, "_runner_epoch", 0)
        # The captured graph unshared, and per call shape which of the two programs runs
        # (``runtime/choice/program_choice.py``); None: always the shared program.
        if not isinstance(graph_module, fx.GraphModule):
            plain = None
        object.__setattr__(self, "_plain", plain)
        object.__setattr__(self, "_choice", ProgramChoice() if plain is not None else None)
        # Per bucket settled on the plain program, it or the original model (``original_arm.py``).
        arm = OriginalArm() if plain is not None and original is not None else None
        object.__setattr__(self, "_originals", arm)
        # Per length class, (FLOPs per request, per candidate), on first use (``prior.py``).
        object.__setattr__(self, "_unit_flops", {})
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
        # ``runtime/follow/dtype_move.py``: the original compiled again for a move to another dtype.
        object.__setattr__(self, "_recompile", recompile)
        object.__setattr__(self, "_original_is_copy", False)  # a moved copy, after such a move
        object.__setattr__(self, "_training", training)
        object.__setattr__(self, "_module", original)  # the model this one stands for
        ddp = DDPWatch(original, self) if training is not None else None
        object.__setattr__(self, "_ddp", ddp)
        object.__setattr__(self, "_eval_mode", eval_mode)
        object.__setattr__(self, "_nesting", nesting)
        if original is not None:
            share_module_state(self, original)  # ``runtime/follow/module_state.py``

    _cache = None  # a ``request_cache.CachedGraph`` when a request cache is attached
    _autocast = None  # ``runtime/modes/autocast.py``: programs for calls under torch.autocast
    _jagged = None  # ``runtime/call/jagged.py``: calls grouped by history length
    _growth = None  # ``runtime/modes/new_sizes.py``: compiled again for a call at new sizes
    jagged_refused = None  # why calls keep their padded width (None: no history length, or jagged)

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
        compile of its original in eval mode (``runtime/modes/eval_mode.py``); an inference compile
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

    def report(self, candidates: int = 1024, requests: int = 1, lengths=None, **renamed):
        """Structured report: roles, FLOPs per request / per candidate, fallbacks, ideal speedup
        at ``requests`` requests of ``candidates`` candidates each, as ``rocs inspect
        --candidates N --requests R``; ``lengths={input: length}`` counts at those history
        lengths (dynamic ones) and marks the nodes that grow with them, and ``{input: [length of
        each request, ...]}`` gives the mean over that distribution (built by the door that
        compiled the model; the runtime knows no report)."""
        if renamed:
            raise TypeError(
                f"report() got {', '.join(sorted(renamed))}=: it takes candidates= (per request, "
                "as `rocs inspect --candidates`) and requests=, e.g. "
                "cm.report(candidates=N // R, requests=R)"
            )
        if self._report_builder is None:
            raise RuntimeError("this compiled model was built without a report")
        built = self._report_builder(candidates * requests, requests, lengths)
        built.jagged = jagged_summary(self._jagged, self.jagged_refused)
        report = self._mislabel.annotate(built)
        return report if self._cache is None else self._cache.annotate(report)

    def cost(self):
        """FLOPs, bytes and ops of a shared-layout call as sympy expressions over R, N and each
        dynamic length, per op (``runtime/program/cost.py``); ``.predict_ms(rocs.calibrate(),
        R=..., N=...)`` gives milliseconds. Computed at each call: keep the result."""
        from .program.cost import program_cost

        if not isinstance(self.graph_module, fx.GraphModule):
            raise RuntimeError("this compiled model runs no graph of its own: it has no cost")
        return program_cost(self.graph_module, self.placeholder_of)

    def cache_stats(self) -> Optional[dict]:
        """Hits, misses, evictions and bytes of the request cache (``runtime/cache/request_cache.py``);
        None when the model has none."""
        return None if self._cache is None else self._cache.stats()

    forward = path.forward  # the call path itself (``runtime/call/path.py``), bound as the method

    call_replicated = path.call_replicated  # the call path's own function, bound as the method

    def program_choices(self) -> dict[tuple, str]:
        """Per call bucket ``(layout, rows bits, requests bits, *length class)`` (the length class:
        the bit length of each dynamic size of the call, ``runtime/call/lengths.py``; none for a
        model without dynamic lengths), the program it runs, ``"shared"`` or ``"plain"``, for the
        buckets decided so far (training calls: layouts ``train-*``, ``"plain"`` being the
        original model; a training compile's calls in eval mode: layouts
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
        (``runtime/call/original_arm.py``)."""
        return {} if self._originals is None else self._originals.decisions()

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
        object.__setattr__(compiled, "_lengths", self._lengths)
        object.__setattr__(compiled, "_jagged", self._jagged)  # calls grouped by length
        object.__setattr__(compiled, "jagged_refused", self.jagged_refused)
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
        (``runtime/follow/guards.py``), then its weights and folded constants brought up to date."""
        self._guards.check()
        if self._weights is not None:
            self._weights.refresh()  # returns at once when no weight moved
        return self.graph_module

    # The module surface and what the call path's parts call back on the model they were handed:
    # the functions themselves, bound as methods (no call in between).
    _apply = moves.move
    _check_model = path.check_model
    _checked_call = path.checked_call
    _call_original = lanes.call_original
    _refresh_copy = moves.refresh_copy
    _graph_runner = lanes.graph_runner
