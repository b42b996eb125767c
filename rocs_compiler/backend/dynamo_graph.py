"""A dynamo graph as an ordinary model: where each placeholder came from, and a forward that
takes the model's named inputs.

Dynamo hands the backend one FX graph per frame whose placeholders are the frame's tensors, module
state and symbolic sizes. Each placeholder's ``grapharg.source`` says where the value came from
(see :mod:`rocs_compiler.backend`); :func:`classify` turns it into a :class:`Slot`, and
:func:`graph_model` wraps the graph in an ``nn.Module`` that ``rocs.compile`` can capture.
"""

from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import fx, nn

from ..formats.leaves import bind_inputs, fresh_identifier, named_leaves

_MODULE_STATE_KEYS = {"_modules", "_parameters", "_buffers"}


# -- where a placeholder came from ----------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """One dynamo placeholder: a model input, module state, a size/stride of an input, or other."""

    kind: str  # "input" | "const" | "value" | "size" | "stride" | "unsupported"
    name: str  # dotted input name, a label for constants, or the source text
    path: tuple = ()  # input: (argument, key, key, ...)
    dim: Optional[int] = None


def _source_chain(source) -> tuple[Any, list]:
    """(root source, [step sources from the root outwards])."""
    steps = []
    while getattr(source, "base", None) is not None:
        steps.append(source)
        source = source.base
    return source, steps[::-1]


def _step_key(step) -> Any:
    from torch._dynamo import source as S

    if isinstance(step, S.AttrSource):
        return step.member
    if isinstance(step, (S.DictGetItemSource, S.GetItemSource)):
        index = step.index
        if isinstance(index, S.ConstDictKeySource):
            return None  # a key known only by position: not nameable
        return index
    return None


def _path_of(source) -> Optional[tuple]:
    """(local name, key, ...) for a value reached from a frame local by item/attr access."""
    from torch._dynamo import source as S

    root, steps = _source_chain(source)
    if not isinstance(root, S.LocalSource):
        return None
    path = [root.local_name]
    for step in steps:
        key = _step_key(step)
        if key is None or not isinstance(key, (str, int)):
            return None
        path.append(key)
    return tuple(path)


def classify(node: fx.Node) -> Slot:
    from torch._dynamo import source as S

    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    example = node.meta.get("example_value")
    label = source.name if source is not None else node.name
    if callable(label):  # older torch: Source.name() is a method
        label = label()
    if source is None:
        return Slot("unsupported", label)
    if getattr(grapharg, "pass_arg_as_tensor", False):
        # A Python float/int that dynamo passes as a 0-d tensor (an unspecialized scalar under
        # dynamic shapes that ``specialized_floats.py`` could not make a constant), or a NumPy
        # array it passes as a tensor made by ``from_numpy`` at every call (a new tensor each
        # time, so neither identity nor ``_version`` tracks it). Its value is baked into the
        # rewritten graph and compared at every call.
        return Slot("value", label)
    if isinstance(source, S.TensorPropertySource):
        path = _path_of(source.base)
        kind = {S.TensorProperty.SIZE: "size", S.TensorProperty.STRIDE: "stride"}.get(source.prop)
        if path is None or kind is None:
            return Slot("unsupported", label)
        return Slot(kind, dotted(path), path, source.idx)
    if not isinstance(example, torch.Tensor):
        return Slot("unsupported", label)
    path = _path_of(source)
    is_state = (
        path is None
        or path[0] == "self"
        or any(k in _MODULE_STATE_KEYS for k in path[1:])
        or isinstance(example, nn.Parameter)
    )
    if is_state:
        return Slot("const", _state_name(source, label))
    return Slot("input", dotted(path), path)


def _state_name(source, label: str) -> str:
    """``head.0.weight`` for ``L['self']._modules['head']._modules['0']._parameters['weight']``."""
    from torch._dynamo import source as S

    root, steps = _source_chain(source)
    keys = (
        []
        if isinstance(root, S.LocalSource) and root.local_name == "self"
        else [getattr(root, "local_name", None) or getattr(root, "global_name", None) or label]
    )
    keys += [k for k in map(_step_key, steps) if k is not None and k not in _MODULE_STATE_KEYS]
    return ".".join(str(k) for k in keys) or label


def dotted(path: tuple) -> str:
    return ".".join(str(k) for k in path)


# -- the dynamo graph as a model ------------------------------------------------------------------


class GraphModel(nn.Module):
    """Runs a dynamo graph from named inputs; module state is held as buffers.

    The graph runs under ``fx.Interpreter`` with node metadata preserved, so the ATen graph that
    capture exports from it keeps each node's ``nn_module_stack`` (reports name the source module).
    """

    def __init__(self, gm: fx.GraphModule, slots: list[Slot], values: list[Any]):
        super().__init__()
        self.gm = gm
        self._slots = slots
        self._const_attrs: dict[int, str] = {}
        self._scalars: dict[int, tuple[Any, torch.dtype]] = {}  # 0-d values
        taken = set(dir(self))
        for i, (slot, value) in enumerate(zip(slots, values)):
            if slot.kind == "const":
                attr = fresh_identifier(re.sub(r"\W", "_", slot.name).strip("_") or "state", taken)
                self.register_buffer(attr, value.detach())
                self._const_attrs[i] = attr
            elif slot.kind == "value" and value.dim() == 0:
                self._scalars[i] = (value.item(), value.dtype)
            elif slot.kind == "value":  # a NumPy array: a constant the analysis may read
                attr = fresh_identifier(re.sub(r"\W", "_", slot.name).strip("_") or "value", taken)
                self.register_buffer(attr, value.detach().clone())
                self._const_attrs[i] = attr
        self.eval()

    def _run(self, args: tuple, kwargs: dict):
        from torch.fx import traceback as fx_traceback

        leaves = named_leaves(bind_inputs(inspect.signature(self.forward), args, kwargs))
        graph_args = []
        for i, slot in enumerate(self._slots):
            if i in self._const_attrs:
                graph_args.append(getattr(self, self._const_attrs[i]))
            elif slot.kind == "value":
                # Made here, not held as a buffer, so that export sees a constant it can fold.
                graph_args.append(torch.tensor(self._scalars[i][0], dtype=self._scalars[i][1]))
            elif slot.kind == "input":
                graph_args.append(leaves[slot.name])
            elif slot.kind == "size":
                graph_args.append(leaves[slot.name].size(slot.dim))
            else:
                graph_args.append(leaves[slot.name].stride(slot.dim))
        with fx_traceback.preserve_node_meta(), warnings.catch_warnings():
            # Dynamo spells ``x.new_tensor(array)`` as ``torch.tensor(from_numpy(array))``, which
            # warns about copy-constructing from a tensor; the user's code did no such thing.
            warnings.filterwarnings("ignore", "To copy construct from a tensor", UserWarning)
            out = fx.Interpreter(self.gm).run(*graph_args)
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)


def graph_model(gm: fx.GraphModule, slots: list[Slot], values: list[Any]) -> GraphModel:
    """A ``GraphModel`` whose forward has one parameter per top-level input argument."""
    arguments = list(dict.fromkeys(s.path[0] for s in slots if s.kind == "input"))
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    signature = inspect.Signature(
        [inspect.Parameter("self", kind), *(inspect.Parameter(a, kind) for a in arguments)]
    )

    def forward(self, *args, **kwargs):
        return self._run(args, kwargs)

    forward.__signature__ = signature
    cls = type("DynamoSubgraph", (GraphModel,), {"forward": forward})
    return cls(gm, slots, values)
