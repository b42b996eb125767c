"""Forwards that write to module state: refused at capture, naming the module and the fix.

The rewritten graph runs the request-side part once per request and owns copies of the model's
weights, so a forward that writes to its own parameters or buffers cannot be reproduced by it: a
functionalized write becomes an extra graph output (the new weight), which a runtime reading
outputs by position would return in place of the model's. Such a forward is refused before it is
rewritten, never compiled into a wrong value.

The common case is ``nn.Embedding(max_norm=...)`` (and ``nn.EmbeddingBag``, ``F.embedding``):
every lookup renormalizes the rows it reads *in place* (``aten.embedding_renorm_``). Its outputs
equal those of the same table with every row renormalized once up front and ``max_norm=None``
(``torch.renorm`` scales a row by ``max_norm / (norm + 1e-7)`` when its norm exceeds
``max_norm``, as ``embedding_renorm_`` does, and a renormalized row is left alone by later
lookups), which is the fix the error suggests.
"""

from __future__ import annotations

import re
from typing import Optional

from torch import fx, nn
from torch.export.graph_signature import OutputKind

from ..errors import CompileError


def _renorm_fix(table: str) -> str:
    return (
        "renormalize the table once before compiling and switch the in-place renorm off, which "
        f"gives the same outputs: `with torch.no_grad(): {table}.weight.copy_(torch.renorm("
        f"{table}.weight, {table}.norm_type, 0, {table}.max_norm)); {table}.max_norm = None`"
    )


def reject_renorming_embeddings(model: nn.Module) -> None:
    """Refuse a model holding an embedding table with ``max_norm`` set, before anything runs it
    (running it would already renormalize the example's rows of the caller's weights)."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
            raise CompileError(
                f"module {name or '<root>'!r} ({type(module).__name__}(max_norm="
                f"{module.max_norm})) renormalizes the weight rows it looks up in place at every "
                f"call; rocs needs a forward without side effects: "
                f"{_renorm_fix('model.' + name if name else 'model')}"
            )


def reject_state_mutation(program, buffers_allowed: bool = False) -> list[str]:
    """Refuse an exported program whose forward writes to a parameter, buffer or input; the
    error names the state, the op that wrote it and the module it ran in. ``buffers_allowed`` (a
    training capture): writes to buffers (batch norm's running statistics) are accepted; returns
    the written buffers' names in output order (export puts them before the user's outputs)."""
    signature = program.graph_signature
    writes = {
        OutputKind.PARAMETER_MUTATION: "parameter",
        OutputKind.BUFFER_MUTATION: "buffer",
        OutputKind.USER_INPUT_MUTATION: "input",
    }
    outputs = _output_nodes(program.graph_module)
    allowed = []
    for spec, node in zip(signature.output_specs, outputs):
        if spec.kind not in writes:
            continue
        if buffers_allowed and spec.kind == OutputKind.BUFFER_MUTATION:
            allowed.append(spec.target.removeprefix("model."))
            continue
        what = f"{writes[spec.kind]} {spec.target.removeprefix('model.')!r}"
        op, path, kind = _writer(node)
        where = f" in module {path!r} ({kind})" if path else ""
        fix = "rocs needs a forward without side effects"
        if op is not None and "embedding_renorm" in op:
            what += " (an embedding lookup with max_norm renormalizes the rows it reads)"
            fix += ": " + _renorm_fix("emb")
        raise CompileError(
            f"the model's forward mutates {what} in place{where}"
            f"{f' ({op})' if op else ''}; {fix}"
        )
    return allowed


def _output_nodes(gm: fx.GraphModule) -> list:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0]
    return list(values) if isinstance(values, (list, tuple)) else [values]


def _writer(node) -> tuple[Optional[str], Optional[str], Optional[str]]:
    """(the op that computed the written value, path and class of the innermost module)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None, None, None
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return str(node.target), None, None
    path, kind = list(stack.values())[-1]
    kind = getattr(kind, "__name__", None) or str(kind).rsplit(".", 1)[-1].strip("'>")
    # Paths start at capture's wrapper ("model.user") or at dynamo's frame ("L['self'].user").
    path = re.sub(r"^(model|L\['self'\])(\.|$)", "", str(path))
    return str(node.target), path or None, kind
