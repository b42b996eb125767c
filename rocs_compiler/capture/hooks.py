"""Module backward hooks: refused by a training capture, naming the module and the fix.

A module's backward hooks (``register_full_backward_hook``, ``register_full_backward_pre_hook``,
``register_backward_hook``, and their global forms) run when autograd reaches the
``BackwardHook`` nodes that ``nn.Module.__call__`` wraps around the module's inputs and outputs.
The compiled graph is ATen ops, not module calls, so those nodes do not exist in it, and a hook
that rescales or records gradients would be skipped without a word. So a training compile of a
model with such a hook is refused. Hooks on tensors are followed: a hook on a parameter
(``p.register_hook``, ``register_post_accumulate_grad_hook``) belongs to the parameter, which the
training program reads itself (``runtime/training/program.py``). Forward hooks are traced into the graph.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as module_state

from ..errors import CompileError


def reject_backward_hooks(model: nn.Module) -> None:
    """Refuse ``model`` when it, or any of its submodules, has a backward hook (module
    docstring); the message names the first module path found."""
    if module_state._global_backward_hooks or module_state._global_backward_pre_hooks:
        raise CompileError(
            "a global module backward hook is registered (register_module_full_backward_hook); "
            "a training compile runs ATen ops, not modules, so it would not run: remove it, or "
            "hook the tensors (p.register_hook) instead"
        )
    for path, module in model.named_modules():
        if module._backward_hooks or module._backward_pre_hooks:
            raise CompileError(
                f"module {path or '(the model)'!r} ({type(module).__name__}) has a backward hook; "
                "a training compile runs ATen ops, not modules, so the hook would not run: remove "
                "it before compiling, or hook its parameters' gradients (p.register_hook) instead"
            )
