"""torch's generated Python bindings for the ATen ops of a direct program.

``torch.ops.aten.reshape.default._op(x, shape)`` reaches the kernel through the op handle's
boxed call: the arguments are matched against the schema by generic code, about 0.5-1.5 us
per call on a CPU more than ``torch.reshape(x, shape)``, whose argument parser is generated for
the op. A direct program of a small ranking model runs a hundred such ops per call, most of
them views and small pointwise ops where that difference is the op's whole cost.

Identity: ``binding(*args, **kwargs) == overload(*args, **kwargs)`` for the C++ bindings torch
generates from the same ``native_functions.yaml`` entry (``torch._C._VariableFunctions.X``,
``torch._C._nn.X``, the ``torch._C.TensorBase.X`` method), when the binding resolves the call
to that overload. Resolution picks the signature whose argument kinds match; the overloads
taken here are the ones an FX node's arguments select (their arguments are built for that
schema): any overload of a pointwise op (between its ``.Tensor`` and ``.Scalar`` forms a Python
number is the same wrapped scalar either way), its in-place variant (the ``TensorBase``
method), and the overloads of ``_REVIEWED``. Every other op keeps its ``_op``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch._ops import OpOverload

from ...analysis import op_groups

_MODULES = (torch._C._VariableFunctions, torch._C._nn, torch._C.TensorBase)

# Non-pointwise overloads whose binding resolves an FX node's arguments to the same overload.
_REVIEWED = frozenset(
    {
        ("addmm", "default"), ("baddbmm", "default"), ("bmm", "default"), ("mm", "default"),
        ("matmul", "default"), ("linear", "default"), ("einsum", "default"),
        ("reshape", "default"), ("view", "default"), ("transpose", "int"), ("t", "default"),
        ("permute", "default"), ("unsqueeze", "default"), ("squeeze", "dim"),
        ("squeeze", "dims"), ("select", "int"), ("expand", "default"), ("expand_as", "default"),
        ("flatten", "using_ints"), ("unflatten", "int"), ("contiguous", "default"),
        ("clone", "default"), ("narrow", "default"), ("split", "Tensor"), ("chunk", "default"),
        ("split_with_sizes", "default"), ("unbind", "int"), ("repeat", "default"),
        ("cat", "default"), ("stack", "default"), ("index_select", "default"),
        ("gather", "default"), ("embedding", "default"), ("sum", "dim_IntList"),
        ("sum", "default"), ("mean", "dim"), ("mean", "default"), ("amax", "default"),
        ("softmax", "int"), ("_softmax", "default"), ("log_softmax", "int"),
        ("_log_softmax", "default"), ("layer_norm", "default"), ("dropout", "default"),
        ("scaled_dot_product_attention", "default"), ("zeros_like", "default"),
        ("ones_like", "default"), ("full_like", "default"), ("cumsum", "default"),
    }
)  # fmt: skip


# Elementwise op families whose binding parses other signatures than their overloads' schemas.
_OTHER_SIGNATURES = frozenset({"to"})


def fast_callable(op: Any) -> Optional[Callable]:
    """The generated binding equivalent to ``op`` (an ATen ``OpOverload``), or None."""
    if not isinstance(op, OpOverload) or op.namespace != "aten":
        return None
    return _binding(op)


@functools.cache
def _binding(op: OpOverload) -> Optional[Callable]:
    name, overload = op.overloadpacket.__name__, op._overloadname
    if op == torch.ops.aten.sym_size.int:
        return torch._C.TensorBase.size
    inplace = name.endswith("_") and not name.startswith("_")
    if inplace:
        allowed = op_groups.inplace_variant(_out_of_place(name, overload)) == op
    else:
        allowed = (name, overload) in _REVIEWED or (
            op_groups.is_elementwise(op)
            and name not in _OTHER_SIGNATURES
            and not overload.endswith("out")
            and _takes_tensor_first(op)
        )
    if not allowed:
        return None
    modules = (torch._C.TensorBase,) if inplace else _MODULES
    for module in modules:
        binding = getattr(module, name, None)
        if binding is not None:
            return binding
    return None


def _takes_tensor_first(op: OpOverload) -> bool:
    # Not the TorchScript overloads on Python numbers (``aten.__and__.bool``).
    arguments = op._schema.arguments
    return bool(arguments) and isinstance(arguments[0].type, torch.TensorType)


def _out_of_place(name: str, overload: str) -> Optional[OpOverload]:
    packet = getattr(torch.ops.aten, name[:-1], None)
    if packet is None or overload not in packet.overloads():
        return None
    return getattr(packet, overload)
