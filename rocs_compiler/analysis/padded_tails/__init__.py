"""What a padded history's tail holds, node by node: the rules of the truncation proof
(``analysis/truncation.py`` is the driver).

A history of length ``L`` (a size symbol of the captured graph) is padded past each row's own
length. The proof shows that every output is the same whether a row is padded to ``L`` or cut to
any width at or past its own length. Each tensor value is described by its dims of size ``L``
(*history dims*) and, per history dim, its **tail**: what the value holds at every position whose
index along that dim lies past the row's length (whatever its other indices):

- :data:`ANY`: finite values that do not matter, provided no later step reads them;
- :class:`Const` ``(v)``: exactly ``v`` (the padding id of the ids, ``False`` of a mask, ``0`` of
  a masked weight, ``-inf`` or a large negative fill of masked scores);
- :data:`MASKED`: at most :data:`MASKING` (a finite large negative plus a finite term), which
  ``exp``, ``softmax`` and ``amax`` treat as ``-inf``;
- :data:`POS`: the position itself (``arange(L)``);
- :data:`NONFINITE`: values that may be ``inf`` or ``nan``.

Identity every rule keeps: at positions inside every row's length a value is the same at any
width. Position-wise ops keep it (each output position reads the same positions of its inputs);
an op that combines positions along a history dim keeps it only when what the tail holds
contributes nothing: a sum or a contraction whose tail is ``0``, a softmax, ``amax`` or attention
whose masked tail gets weight ``0`` (these need a row with at least one position: a row without
any runs at full width), a scan (a position reads earlier positions only). Every other op that
combines positions along a history dim, or along the rows (candidates), refuses the proof, naming
itself; an op without a rule refuses when it reads a history or the rows.

Rules are pure functions of the node and its inputs' states (:class:`Value`), registered per
ATen op in one table by family (``table.py``; rules in ``positions.py`` and ``combining.py``,
the lattice in ``lattice.py``).
"""

from . import table  # noqa: F401 - fills the registry
from .lattice import ANY, CLEAN, Const, Context, Refused, Size, Value, rule_for

__all__ = ["ANY", "CLEAN", "Const", "Context", "Refused", "Size", "Value", "rule_for"]
