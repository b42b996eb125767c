"""One interface for every input format a compiled model accepts.

A *format* maps the user's call (the original model's arguments, in one of the three layouts)
to the call of the compiled program, whose inputs are named tensor leaves, and back to the
original model where that one runs instead. The compiled model (``runtime/compiled_model.py``)
is one class that holds one format; layouts, checks, the program choice, reports and weight
refresh are its own, never a format's.

- :class:`InputFormat` itself: tensors by argument name, dict keys, list items and dataclass
  fields (``leaves.py`` names them); the program takes the call as it is.
- ``columns.ColumnFormat``: column ranges of one packed 2-D argument (``"X[:, 0:12]"``); the
  program takes the argument as a dict of column views.
- ``kjt.KJTFormat``: keys of TorchRec ``KeyedJaggedTensor`` arguments
  (``"sparse_features[user_id]"``); the program takes every key as padded rows.

Adding a format means one module here with a subclass of :class:`InputFormat` and a case in
``select.py``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from .leaves import bind_inputs, covers, named_leaves, replace_leaves

DROPIN, SHARED, REPLICATED = "dropin", "shared", "replicated"


@dataclass
class ProgramCall:
    """A call in the compiled program's terms.

    ``layout`` is :data:`DROPIN` (replicated rows, requests to be found), :data:`SHARED`
    (request leaves with one row per request) or :data:`REPLICATED` (request leaves with one
    row per candidate and the grouping ``index`` known). In the shared layout, ``replicated``
    names request leaves that still come with one row per candidate (a packed argument's
    request columns, which share their rows with its candidate columns): the runtime checks
    them constant within each request and keeps one row per request.
    """

    args: tuple
    kwargs: dict
    index: Optional[torch.Tensor]
    layout: str
    replicated: frozenset[str] = field(default_factory=frozenset)
    # Tensors of the call as given that the plain program takes in place of leaves made from
    # them (a packed argument whole, by its leaf name: ``InputFormat.plain_graph``).
    given: dict = field(default_factory=dict)


@dataclass(frozen=True)
class OriginalProgram:
    """The original model run on the user's own call, a cheaper program than converting the
    call for the compiled one on some models; the call's layout, candidate rows and number of
    requests (0: not known without finding them) place it in a program-choice bucket."""

    layout: str
    rows: int
    requests: int
    run: Callable[[], Any]
    index: Optional[torch.Tensor] = None  # the grouping the call states, range-checked first


class InputFormat:
    """Tensors as they are: the program's call is the user's call (``converts`` is False)."""

    converts = False
    name = "tensors"
    offers_original = False  # whether :meth:`original_program` can offer the original model

    def __init__(self, signature: inspect.Signature, request_names: Sequence[str]):
        self.signature = signature
        self.request_names = list(request_names)  # names of plain (non-format) request leaves

    def program_call(
        self, args: tuple, kwargs: dict, index: Optional[torch.Tensor], replicated: bool
    ) -> ProgramCall:
        """The user's call in the program's terms; ``replicated`` for ``call_replicated``."""
        if index is None:
            return ProgramCall(args, kwargs, None, DROPIN)
        return ProgramCall(args, kwargs, index, REPLICATED if replicated else SHARED)

    def plain_graph(self, gm, input_names: Sequence[str]) -> tuple[Any, list[str]]:
        """The plain program's graph and its input names: ``gm`` over the program's inputs
        (``input_names``) as it is, unless the format can give it the call's own tensors
        (``ProgramCall.given``) in place of what it makes of them."""
        return gm, list(input_names)

    def called_leaves(self, args: tuple, kwargs: dict) -> Optional[dict]:
        """The call's tensors by the names of :meth:`plain_graph`'s inputs, when the format's
        plain program takes them as called and they are named without converting the call;
        None: the call is converted (``program_call``)."""
        return None

    def original_program(
        self, original: nn.Module, args: tuple, kwargs: dict, index: Optional[torch.Tensor]
    ) -> Optional[OriginalProgram]:
        """The original model on this call, when the format offers it to the program choice
        in place of the compiled program's plain version; None: the plain program runs."""
        return None

    def original_sizes(self, args: tuple, kwargs: dict) -> Optional[tuple]:
        """``(layout, rows, requests)`` of a call without ``candidate_to_request`` that the format
        offers to the original model as called (:meth:`original_program`), read without binding
        the call: a drop-in call (requests 0), or a shared call that states its grouping itself
        (a KJT's inverse indices, left to the original model, which reads them); None when it
        cannot say so quickly (:meth:`original_program` then decides, checking the grouping)."""
        return None

    def run_original(
        self, original: nn.Module, args: tuple, kwargs: dict, index: Optional[torch.Tensor]
    ) -> Any:
        """The original model on the call in replicated layout (an eager fallback): request
        leaves given with one row per request are gathered to the candidates."""
        if index is not None:
            args, kwargs = self.replicate_plain_leaves(args, kwargs, index)
        return original(*args, **kwargs)

    def replicate_plain_leaves(self, args: tuple, kwargs: dict, index: torch.Tensor):
        """The call with every plain request leaf gathered with ``index``."""
        if not self.request_names:
            return args, kwargs
        leaves = named_leaves(bind_inputs(self.signature, args, kwargs))
        gathered = {
            name: leaf.index_select(0, index)
            for name, leaf in leaves.items()
            if isinstance(leaf, torch.Tensor)
            and any(covers(request, name) for request in self.request_names)
        }
        return replace_leaves(self.signature, args, kwargs, gathered)



@dataclass
class Prepared:
    """What a door compiles for a format: the model the pipeline captures (a wrapper taking
    the program's inputs), its request leaf names and example call, and the format."""

    model: nn.Module
    request_inputs: list[str]
    args: tuple
    kwargs: dict
    format: InputFormat
    failure: Optional[Exception] = None  # a CompileError met while preparing: nothing to capture
    # Modules of ``model`` that are shallow copies of the user's, each with the user's module it
    # stands in for (``kjt_lookups.py`` copies the parents of the modules it replaces).
    stand_ins: dict[nn.Module, nn.Module] = field(default_factory=dict)

    def watched(
        self, user_model: nn.Module, reads: dict, weight_names: Mapping[str, str]
    ) -> tuple[nn.Module, dict, dict[str, str]]:
        """What the compiled model follows (weights) and guards (structure, attributes):
        ``(module, reads, weight names)``, given capture's reads and weight names of ``model``.

        ``model`` itself, unless it holds stand-ins: their child tables are their own, so a
        module the user replaces after compiling (``model.over_arch = ...``) is seen only in
        ``user_model``. Then it is ``user_model``, with each stand-in's reads taken as its
        original's and each weight named by its path in ``user_model``. Identity relied on: a
        stand-in shares its original's parameters, buffers and attribute values (a shallow copy),
        so the same tensor is found under the user's path; the reads of modules of ours (the
        wrappers) are not the user's to change and are left out by the guards, which skip a
        module ``user_model`` does not reach.
        """
        if not self.stand_ins:
            return self.model, reads, dict(weight_names)
        paths: dict[int, str] = {}
        for named in (
            user_model.named_parameters(remove_duplicate=False),
            user_model.named_buffers(remove_duplicate=False),
        ):
            for path, tensor in named:
                paths.setdefault(id(tensor), path)
        names = {}
        for attr, name in weight_names.items():
            tensor = _registered(self.model, name)
            # A name with no tensor behind it (a constant lifted from forward) is no weight in
            # either model: an empty name, which never resolves, keeps it that way.
            names[attr] = paths.get(id(tensor), "") if tensor is not None else ""
        originals = {self.stand_ins.get(module, module): table for module, table in reads.items()}
        return user_model, reads.with_modules(originals), names


def _registered(model: nn.Module, name: str) -> Optional[torch.Tensor]:
    """The parameter or buffer registered in ``model`` under the dotted ``name``, or None."""
    prefix, _, leaf = name.rpartition(".")
    try:
        owner = model.get_submodule(prefix)
    except AttributeError:
        return None
    found = owner._parameters.get(leaf, owner._buffers.get(leaf))
    return found if isinstance(found, torch.Tensor) else None


def prepare_leaves(
    model: nn.Module, request_inputs: Sequence[str], args: tuple, kwargs: Mapping[str, Any]
) -> Prepared:
    """The plain format: the model and its call as they are."""
    signature = inspect.signature(model.forward)
    names = list(request_inputs)
    return Prepared(model, names, tuple(args), dict(kwargs), InputFormat(signature, names))
