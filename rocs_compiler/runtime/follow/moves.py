"""A compiled model moved with ``.to()``, ``.double()`` or ``.type()``: its programs' tensors
moved with it, or, for another floating dtype, the original compiled again and adopted
(``dtype_move.py``).

Identity: a moved compiled model computes what its original, moved the same way, computes.
"""

from __future__ import annotations

from torch import nn

from .dtype_move import dtype_move, keep_integer_dtypes

# What ``adopt`` leaves as it is: nn.Module's own state, and what watches the original.
MODULE_STATE = frozenset(vars(nn.Module()))
_KEPT_ON_MOVE = frozenset(
    {"_guards", "_weights_from", "_recompile", "_module", "_eval_mode", "_autocast", "_nesting"}
)


def move(cm, fn, recurse=True):
    """``nn.Module._apply`` of the compiled model ``cm`` (``.to()``, ``.double()``, ``.type()``)."""
    fn = keep_integer_dtypes(fn)  # ``cm.type(dtype)`` moves floating tensors only
    if cm._eval_mode is not None:
        cm._eval_mode.moved(fn)
    if cm._autocast is not None:
        cm._autocast.moved(fn)
    if cm._recompile is not None:
        held = cm._weights.held() if cm._weights is not None else []
        inputs = cm._input_specs.empty_tensors() if cm._input_specs is not None else []
        target = dtype_move(fn, held + inputs)
        if target is not None:  # compiled again for the new dtype
            adopt(cm, cm._recompile(*target), target)
            return cm
    # ``.to()`` and friends may replace the graph's buffers: rebuild the runner on next call,
    # and find out again which weights still alias the original's. The original's own
    # tensors (the compiled model's parameters) stay as they are.
    object.__setattr__(cm, "_runner", None)
    if isinstance(cm.graph_module, nn.Module):
        cm.graph_module._apply(fn, recurse)
    if cm._plain is not None:
        cm._plain.moved(fn)
    if cm._input_specs is not None:
        cm._input_specs = cm._input_specs.moved(fn)
    if cm._weights is not None:
        cm._weights.bind()
    return cm


def adopt(cm, new, moved_to: tuple) -> None:
    """Run ``new``'s programs (compiled from a moved copy of the original, which its eager
    paths run), still guarding the original and following its weights, as cast copies."""
    base = cm._weights_from if cm._weights_from is not None else cm._original
    for name, value in vars(new).items():
        if name not in MODULE_STATE and name not in _KEPT_ON_MOVE:
            object.__setattr__(cm, name, value)
    cm.graph_module = new.graph_module
    if new._weights is not None:
        object.__setattr__(cm, "_weights", new._weights.following(base))
    if cm._plain is not None:
        cm._plain.follow(base)
    if new._training is not None:  # the training program reads the original, cast
        object.__setattr__(cm, "_training", new._training.following(base, *moved_to))
    # A length the moved program was not compiled for is refused: compiled again from the moved
    # copy, its program would follow the copy's weights, not the original's.
    object.__setattr__(cm, "_growth", None)
    object.__setattr__(cm, "_original_is_copy", True)


def refresh_copy(cm) -> None:
    """Before the eager model runs: a moved copy's weights are the graph's cast copies of
    the original's, brought up to date by a refresh."""
    weights = cm._weights
    if cm._original_is_copy and weights is not None and not weights.current():
        weights.refresh()
