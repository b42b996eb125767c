"""Helpers shared by the IKBO ops: device dispatch, optional Triton, input checks.

Environment variables (read at call time, so tests can flip them per call):

- ``ROCS_TRITON_ON_CPU=1``: route CPU tensors through the Triton launchers. Only meaningful
  together with ``TRITON_INTERPRET=1`` (set before Triton is imported); tests use it to run
  the full op path, launcher included, on CPU.
- ``ROCS_DEBUG_CHECKS=1``: a ``rocs::`` op called on CUDA tensors also checks that
  ``candidate_to_request`` is in range (a device sync). On CPU the range check always runs
  because it is cheap and the Triton interpreter does not catch out-of-bounds loads.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch

# Dtypes the Triton kernels are written for; anything else (float64, say) takes the torch path
# on every device, which is exact.
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def debug_checks() -> bool:
    return env_flag("ROCS_DEBUG_CHECKS")


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return env_flag("TRITON_INTERPRET")


@functools.cache
def triton_available() -> bool:
    # find_spec does not import triton (slow); a blocked or broken entry counts as absent.
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def _warn_no_triton() -> None:
    warnings.warn(
        "rocs: triton is not installed; IKBO ops on CUDA tensors run their torch path",
        RuntimeWarning,
        stacklevel=3,
    )


def use_triton(*tensors: torch.Tensor) -> bool:
    """Decide, at call time, whether an op runs its Triton launcher or its torch path."""
    first = tensors[0]
    if first.is_cuda:
        if any(t.dtype not in TRITON_DTYPES for t in tensors):
            return False
        if triton_available():
            return True
        _warn_no_triton()
        return False
    # On the CPU the (rarely set) flag decides first: one environment read per op call.
    if first.device.type == "cpu" and env_flag("ROCS_TRITON_ON_CPU"):
        if any(t.dtype not in TRITON_DTYPES for t in tensors):
            return False
        if not triton_available():
            raise RuntimeError("ROCS_TRITON_ON_CPU=1 but triton is not installed")
        return True
    return False


def check_launch_device(*tensors: torch.Tensor) -> None:
    """Launcher precondition: CUDA tensors, or CPU tensors under the Triton interpreter."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(
                f"rocs: all tensors must be on one device, got {t.device} and {device}"
            )
    if device.type == "cpu" and not interpreting():
        raise RuntimeError(
            "rocs: Triton kernels need CUDA tensors; CPU tensors only run under TRITON_INTERPRET=1"
        )


def check_same_dtype(op: str, **tensors: torch.Tensor) -> torch.dtype:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"rocs::{op}: tensors must share one dtype, got {dtypes}")
    return next(iter(dtypes.values()))


def check_launch_dtypes(op: str, **tensors: torch.Tensor) -> None:
    """Launcher precondition: one floating dtype the kernels are written for."""
    dtype = check_same_dtype(op, **tensors)
    if dtype not in TRITON_DTYPES:
        raise TypeError(f"rocs::{op}: Triton kernels take {TRITON_DTYPES}, got {dtype}")


def check_contiguous(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"rocs::{op}: launcher expects {name} contiguous")


def check_shape(op: str, name: str, t: torch.Tensor, shape: tuple) -> None:
    """``shape`` entries are ints or ``None`` (any size)."""
    ok = t.dim() == len(shape) and all(s is None or t.shape[i] == s for i, s in enumerate(shape))
    if not ok:
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"rocs::{op}: {name} must have shape [{want}], got {list(t.shape)}")
