"""Triton-side helpers shared by the kernel modules. Importing this module imports triton.

Only the kernel modules (``*_kernels.py``, generated pointwise kernels) import it, and the
ops import those lazily, so the package works without triton installed.
"""

from __future__ import annotations

import torch
import triton

from rocs_compiler.kernels.common import interpreting


def autotune_configs(configs: list[triton.Config], interpret: triton.Config) -> list[triton.Config]:
    """The tuning space on a GPU; a single config under the interpreter.

    The interpreter runs each program in Python (about a millisecond each) and would
    benchmark every config, so there it sees exactly one config with large blocks.
    """
    return [interpret] if interpreting() else configs


def input_precision(dtype: torch.dtype) -> str | None:
    """``tl.dot`` precision that matches torch's matmul for ``dtype``.

    float32 matmuls in torch use full precision unless TF32 was allowed, so the kernels do
    too. For 16-bit inputs (and allowed TF32) ``None`` keeps the backend default: 16-bit
    products are exact in the float32 accumulator.
    """
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return None


def next_pow2_at_least(x: int, floor: int = 16) -> int:
    """Block size covering ``x`` (``tl.dot`` needs every block dim >= 16)."""
    return max(floor, triton.next_power_of_2(max(int(x), 1)))
