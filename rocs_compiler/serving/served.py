"""A model behind the server: its input fields and the two ways to run a packed call.

Three sources give a :class:`ServedModel` (:func:`served_model`):

- a ``CompiledModel`` (``rocs.compile``): fields are its tensor inputs by compile-time name,
  and KeyedJaggedTensor keys as ``"<argument>[<key>]"`` (a row is a list of ids); the shared call
  is the compiled model's, with ``candidate_to_request`` taken on trust since packing built it;
- a saved program (``rocs.save`` output, loaded with ``rocs.load``): fields are the program's
  inputs (a KJT key as its padded pieces ``sparse_features.user_id.ids``/``.lengths``);
- an AOTInductor package (``rocs.aoti_package`` output): the same fields, read from the
  package's metadata (its compiled code has no graph to read them from);
- a path to such a file, or a no-argument factory returning any of the above (what a Ray
  replica calls in its own process).

Where there is a graph (a compiled model, a saved program), each id field carries the rows of
the embedding tables it looks up (``id_ranges.py``), which the per-request check enforces.

``plain=True`` runs the same packed call as the original model would take it, request rows
replicated to the candidates: the baseline a user compares on their own traffic. For a compiled
model that is the original model (its input format gathers the rows); for a saved program,
which has no original, it is the program with every candidate its own request (R = N).
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import CompileError, InputError
from ..formats.columns import ColumnFormat
from ..formats.kjt import KJTFormat
from ..formats.leaves import named_leaves
from ..formats.names import covers, nest
from ..ir.graph_meta import INDEX_NAME
from ..kernels.index_contract import trusted_index
from .id_ranges import id_ranges
from .packing import Jagged, Packed
from .schema import CANDIDATE, REQUEST, Field, Schema


class ServedModel:
    """A model's fields (:class:`Schema`), its name, and its shared and plain runs."""

    def __init__(
        self,
        name: str,
        schema: Schema,
        shared: Callable[[Packed], Any],
        plain: Callable[[Packed], Any] | None,
        kind: str,
    ):
        self.name = name
        self.schema = schema
        self.kind = kind
        self._shared = shared
        self._plain = plain

    @property
    def has_plain(self) -> bool:
        return self._plain is not None

    def __call__(self, packed: Packed, plain: bool = False) -> Any:
        if plain and self._plain is None:
            raise CompileError(f"{self.name}: no original model to serve plain")
        run = self._plain if plain else self._shared
        with torch.inference_mode():
            return run(packed)

    def info(self) -> dict:
        return {
            "model": self.name,
            "kind": self.kind,
            "inputs": self.schema.describe(),
            "request_inputs": [f.name for f in self.schema.request_fields],
        }


def served_model(source: Any, name: str | None = None) -> ServedModel:
    """A :class:`ServedModel` from a compiled model, a loaded program, a path to a saved program
    or an AOTInductor package, or a no-argument factory returning one of them (or a
    :class:`ServedModel` itself: the benchmark's no-op model)."""
    from ..export import LoadedProgram, load
    from ..runtime import CompiledModel

    if isinstance(source, ServedModel):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path):
            raise InputError(f"no such artifact: {path}")
        if is_aoti_package(path):
            return _from_aoti(path, name or os.path.basename(path))
        return _from_program(load(path), name or os.path.basename(path))
    if isinstance(source, CompiledModel):
        return _from_compiled(source, name or _model_name(source))
    if isinstance(source, LoadedProgram):
        return _from_program(source, name or "program")
    if callable(source):
        return served_model(source(), name or getattr(source, "__name__", None))
    raise InputError(
        f"cannot serve a {type(source).__name__}: give a CompiledModel, a program from "
        "rocs.load, a path to a saved program, or a factory returning one"
    )


def _model_name(compiled) -> str:
    original = getattr(compiled, "_original", None)
    return type(original).__name__ if original is not None else "compiled model"


# -- a compiled model -----------------------------------------------------------------------------


def _from_compiled(cm, name: str) -> ServedModel:
    if cm.graph_module is None:
        raise CompileError(
            f"{name}: the model runs eagerly ({cm.fallback_reason}); nothing to serve"
        )
    contract = cm.contract
    if isinstance(cm.input_format, ColumnFormat):
        raise InputError(
            f"{name}: models compiled with column ranges of a packed input are not served yet; "
            "compile with the columns as separate inputs"
        )
    splits = list(cm.input_format.splits) if isinstance(cm.input_format, KJTFormat) else []
    kjt_arguments = {s.argument for s in splits}
    values = {
        n.name: n.meta.get("val") for n in cm.graph_module.graph.nodes if n.op == "placeholder"
    }
    # placeholder -> field: a KJT key's ids are the jagged field's values
    served_as = {cm.placeholder_of[leaf]: leaf for leaf in contract.input_names}
    for split in splits:
        for key in split.keys:
            placeholder = cm.placeholder_of.get(f"{split.argument}.{key}.ids")
            if placeholder is not None:
                served_as[placeholder] = f"{split.argument}[{key}]"
    ranges = id_ranges(cm.graph_module.graph, served_as, _table_rows(cm.graph_module), INDEX_NAME)
    fields = []
    for leaf in contract.input_names:
        if leaf.split(".")[0] in kjt_arguments:
            continue
        val = values[cm.placeholder_of[leaf]]
        side = REQUEST if any(covers(r, leaf) for r in contract.request_inputs) else CANDIDATE
        batched = contract.batched.get(leaf, False) and isinstance(val, torch.Tensor)
        fields.append(_field(name, leaf, getattr(val, "dtype", None),
                             tuple(val.shape) if batched else (), batched, side,
                             ranges.get(leaf, ())))  # fmt: skip
    for split in splits:
        if split.weighted:
            raise InputError(
                f"{name}: weighted KeyedJaggedTensor {split.argument!r} is not served yet"
            )
        for key in split.keys:
            side = REQUEST if key in split.request else CANDIDATE
            field_name = f"{split.argument}[{key}]"
            fields.append(Field(field_name, side, torch.int64, (), jagged=True,
                                ids=tuple(ranges.get(field_name, ()))))  # fmt: skip
    schema = Schema(fields)
    dense = [f.name for f in fields if not f.jagged]

    def call(packed: Packed) -> dict:
        kwargs = nest({tuple(n.split(".")): packed.leaves[n] for n in dense})
        for split in splits:
            kwargs[split.argument] = _kjt(split, packed)
        return kwargs

    def shared(packed: Packed) -> Any:
        with trusted_index():
            return cm(**call(packed), candidate_to_request=packed.index)

    original = getattr(cm, "_original", None)  # the runtime keeps the model it was compiled from

    def plain(packed: Packed) -> Any:
        return cm.input_format.run_original(original, (), call(packed), packed.index)

    return ServedModel(name, schema, shared, plain if original is not None else None, "compiled")


def _kjt(split, packed: Packed):
    """The shared-layout KeyedJaggedTensor of one argument: request keys with R rows, candidate
    keys with N (TorchRec's stride per key)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = list(split.keys)
    pieces: list[Jagged] = [packed.leaves[f"{split.argument}[{k}]"] for k in keys]
    strides = [packed.num_requests if k in split.request else packed.num_candidates for k in keys]
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([p.values for p in pieces]),
        lengths=torch.cat([p.lengths for p in pieces]),
        stride_per_key_per_rank=[[s] for s in strides],
    )


def _field(
    model: str, leaf: str, dtype: torch.dtype, shape, batched: bool, side: str, ids=()
) -> Field:
    """``shape``: the input's sizes, a dynamic one as anything but an int; ``ids``: the id ranges
    of its values (``id_ranges.IdRange``)."""
    if not batched or not shape:
        raise InputError(
            f"{model}: input {leaf!r} has no row per request or candidate (it is passed whole to "
            "every call); a served model takes every tensor input per row"
        )
    sizes = tuple(s if isinstance(s, int) else None for s in shape[1:])
    return Field(leaf, side, dtype, sizes, ids=tuple(ids))


def _table_rows(owner: torch.nn.Module | None, inputs: frozenset = frozenset()):
    """The rows of the table a graph node holds: a 2-D weight (``get_attr`` of ``owner``, or a
    lifted placeholder that is none of ``inputs``), else None."""

    def rows(node) -> int | None:
        if node.op not in ("get_attr", "placeholder") or node.name in inputs:
            return None
        value = node.meta.get("val")
        if value is None and node.op == "get_attr" and owner is not None:
            value = getattr(owner, str(node.target), None)
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            return None
        return value.shape[0] if isinstance(value.shape[0], int) else None

    return rows


# -- a saved program, an AOTInductor package ------------------------------------------------------


def _from_program(program, name: str) -> ServedModel:
    from ..export import input_signature

    exported = program.program
    user_inputs = list(exported.graph_signature.user_inputs)
    served_as = dict(zip(user_inputs, _leaf_names(exported)))
    rows = _table_rows(None, frozenset(user_inputs))
    ranges = id_ranges(exported.graph, served_as, rows, _index_placeholder(served_as))
    return _from_signature(name, input_signature(exported), program.module(), "saved program",
                           ranges)  # fmt: skip


def _leaf_names(exported) -> list[str]:
    """The program's keyword inputs by leaf name, in the order of its user inputs."""
    in_spec = exported.call_spec.in_spec
    _, kwargs = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    by_position = {i: leaf for leaf, i in named_leaves(kwargs).items()}
    return [by_position[i] for i in range(len(by_position))]


def _index_placeholder(served_as: dict[str, str]) -> str:
    return next((p for p, leaf in served_as.items() if leaf == INDEX_NAME), INDEX_NAME)


def _from_aoti(path: str, name: str) -> ServedModel:
    """An AOTInductor package from ``rocs.aoti_package``, its inputs read from its metadata."""
    from ..export import INPUTS_METADATA

    runner = torch._inductor.aoti_load_package(path)
    described = runner.get_metadata().get(INPUTS_METADATA)
    if described is None:
        raise CompileError(
            f"{name}: an AOTInductor package without rocs's description of its inputs; "
            "package the program with rocs.aoti_package(program, path)"
        )
    return _from_signature(name, json.loads(described), runner, "AOTInductor package")


def is_aoti_package(path: str) -> bool:
    """True for a ``.pt2`` archive holding AOTInductor code (not a ``torch.export`` program)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any("/data/aotinductor/" in n for n in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def _from_signature(
    name: str, signature: dict, module: Callable, kind: str, ranges: dict | None = None
) -> ServedModel:
    """Fields from a program's input signature (``export.input_signature``): a candidate input has
    the index's rows (its first size is the index's symbol), a request input another symbol;
    ``ranges``: the id ranges by leaf (none for an AOTInductor package, which has no graph)."""
    ranges = ranges or {}
    signature = dict(signature)
    index_entry = signature.pop(INDEX_NAME, None)
    if index_entry is None:
        raise CompileError(f"{name}: not a rocs program (no {INDEX_NAME} input)")
    candidates_symbol = index_entry["shape"][0]
    fields = []
    for leaf, entry in signature.items():
        if entry is None:
            raise InputError(
                f"{name}: input {leaf!r} is not a tensor; a served model takes every input per row"
            )
        dtype = getattr(torch, entry["dtype"])
        shape = entry["shape"]
        batched = bool(shape) and isinstance(shape[0], str)
        side = CANDIDATE if batched and shape[0] == candidates_symbol else REQUEST
        fields.append(_field(name, leaf, dtype, shape, batched, side, ranges.get(leaf, ())))
    schema = Schema(fields)
    names = [f.name for f in fields]
    requests = [f.name for f in schema.request_fields]

    def shared(packed: Packed) -> Any:
        kwargs = nest({tuple(n.split(".")): packed.leaves[n] for n in names})
        return module(**kwargs, candidate_to_request=packed.index)

    def plain(packed: Packed) -> Any:
        leaves = dict(packed.leaves)
        for n in requests:
            leaves[n] = leaves[n].index_select(0, packed.index)
        kwargs = nest({tuple(n.split(".")): leaves[n] for n in names})
        identity = torch.arange(packed.num_candidates)
        return module(**kwargs, candidate_to_request=identity)

    return ServedModel(name, schema, shared, plain, kind)
