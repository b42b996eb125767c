"""Names for a program's dynamic sizes: ``R``, ``N`` and one per length.

``torch.export`` numbers its symbols (``s23``, ``s26``) whatever the ``Dim`` names it was given;
the same numbers reach the ONNX model's dims and :func:`~rocs_compiler.export.input_signature`.
A rocs program's sizes have fixed meanings, read off its input signature:

- ``N``: the rows of ``candidate_to_request`` (and of every candidate input);
- ``R``: the rows of the request inputs (the other symbol of a first dim);
- ``L_<input>``: any other dynamic size (a padded history length), after the first input that
  holds it (``L_<input>_<dim>`` beyond its dim 1), dots of dict leaves as underscores.

Sizes that share a symbol share a name, so equal names still mean equal sizes.
"""

from __future__ import annotations

from ..ir.graph_meta import INDEX_NAME

CANDIDATE_ROWS = "N"
REQUEST_ROWS = "R"


def size_names(signature: dict[str, dict | None]) -> dict[str, str]:
    """``{symbol: name}`` for every symbolic size in ``signature`` (leaf -> ``{"shape": [...]}``,
    the index's entry included), sizes given as symbol strings."""
    names: dict[str, str] = {}
    index = signature.get(INDEX_NAME)
    if index is not None and index["shape"] and isinstance(index["shape"][0], str):
        names[index["shape"][0]] = CANDIDATE_ROWS
    for entry in signature.values():
        shape = entry["shape"] if entry is not None else []
        if shape and isinstance(shape[0], str) and shape[0] not in names:
            names[shape[0]] = REQUEST_ROWS
            break
    for leaf, entry in signature.items():
        shape = entry["shape"] if entry is not None else []
        for dim, size in enumerate(shape):
            if isinstance(size, str) and size not in names:
                stem = f"L_{leaf.replace('.', '_')}"
                names[size] = stem if dim == 1 else f"{stem}_{dim}"
    return names


def with_size_names(signature: dict[str, dict | None]) -> dict[str, dict | None]:
    """``signature`` with each symbolic size replaced by its name (:func:`size_names`)."""
    names = size_names(signature)

    def named(entry: dict) -> dict:
        return {
            **entry,
            "shape": [names.get(s, s) if isinstance(s, str) else s for s in entry["shape"]],
        }

    return {leaf: None if entry is None else named(entry) for leaf, entry in signature.items()}
