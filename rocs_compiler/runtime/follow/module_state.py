"""The compiled model is its original model as an ``nn.Module``: the same parameters, buffers,
submodules and mode.

A compiled model is used where its original was: handed to an optimizer (``cm.parameters()``),
wrapped by DistributedDataParallel or FSDP2, held by a parent module that calls ``.eval()``,
saved with ``state_dict()``. So it holds the original's own ``_parameters``, ``_buffers`` and
``_modules`` dicts (the same dict objects, not copies) and its state-dict hooks: every walk of
nn.Module's tree (``named_parameters``, ``named_buffers``, ``named_modules``, ``state_dict``,
``load_state_dict``, ``zero_grad``, ``requires_grad_``, an engine's hooks and flat parameter
lists) sees exactly the original's tensors under the original's names, and a reassignment made
through either module is seen by both. The program's aliases of those weights (the graph
module's attributes) are plain attributes of the compiled model, never registered: no engine
sees them as parameters or buffers (DDP would broadcast every buffer at every step).

Identity relied on: nn.Module's tree walks read only those dicts (and ``training``, which
``CompiledModel.train`` keeps equal to the original's by switching the original), so on them a
module holding the original's dicts is indistinguishable from the original.

Not shared: forward hooks (the compiled model's ``forward`` is its own) and the device and
dtype, which ``CompiledModel._apply`` changes for the program only (docs/contract.md: the
original keeps its own device and dtype).
"""

from __future__ import annotations

from torch import nn

# The original's dicts the compiled model holds as its own.
SHARED = (
    "_parameters",
    "_buffers",
    "_non_persistent_buffers_set",
    "_modules",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def share_module_state(module: nn.Module, original: nn.Module) -> None:
    """Make ``module`` hold ``original``'s parameters, buffers, submodules and mode."""
    for name in SHARED:
        object.__setattr__(module, name, getattr(original, name))
    object.__setattr__(module, "training", original.training)
