"""Jitted math helpers for generated pointwise kernels (imports triton).

Kept to what ``triton.language`` lacks on every backend, the CPU interpreter included
(libdevice calls do not run there).
"""

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    # tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1]: no overflow for any x.
    # Absolute error is a few float32 ulps of 1; torch.tanh agrees to about 1e-7.
    e = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -y, y)
