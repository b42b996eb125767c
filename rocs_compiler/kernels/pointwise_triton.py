"""Compile, cache and launch generated pointwise kernels (imports triton; loaded lazily).

``@triton.jit`` needs real source (it reads the function's file), so the text from
``pointwise_program.kernel_source`` is written to a cache directory, named by a hash of the
text, and imported from there. Compiled kernels are memoized by
``(canonical program, #candidate inputs, #request inputs, dtype)``; Triton then keeps one
binary per specialization (dtype, alignment) of that kernel.

Cache directory: ``$ROCS_KERNEL_CACHE_DIR`` if set, else
``$XDG_CACHE_HOME/rocs_compiler/kernels`` (``~/.cache/...``); a temporary directory if that
is not writable. Files are written atomically, so concurrent processes can share it.

Launch: 1-D grid over the flattened output, BLOCK elements per program. Tested in
``tests/kernels/triton_cases.py``; generated text is pinned by golden files in
``tests/kernels/golden/``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading

import torch
import triton

from rocs_compiler.kernels.common import (
    check_contiguous,
    check_launch_device,
    check_launch_dtypes,
    interpreting,
)
from rocs_compiler.kernels.pointwise_program import KERNEL_NAME, Node, format_program, kernel_source

_lock = threading.Lock()
_kernels: dict[tuple, object] = {}


def cache_dir() -> str:
    path = os.environ.get("ROCS_KERNEL_CACHE_DIR")
    if not path:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = os.path.join(base, "rocs_compiler", "kernels")
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(path)
    except OSError:
        path = os.path.join(tempfile.gettempdir(), f"rocs_kernels_{os.getuid()}")
        os.makedirs(path, exist_ok=True)
    return path


def _import_source(source: str):
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    module_name = f"rocs_generated_pointwise_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = os.path.join(cache_dir(), f"pointwise_{digest}.py")
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".py.tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def get_kernel(program: Node, num_candidate: int, num_request: int, dtype: torch.dtype):
    key = (format_program(program), num_candidate, num_request, dtype)
    with _lock:
        kernel = _kernels.get(key)
        if kernel is None:
            module = _import_source(kernel_source(program, num_candidate, num_request))
            kernel = _kernels[key] = getattr(module, KERNEL_NAME)
    return kernel


def broadcast_pointwise(
    program: Node,
    candidate_inputs: list[torch.Tensor],
    request_inputs: list[torch.Tensor],
    idx: torch.Tensor,
) -> torch.Tensor:
    op = "broadcast_pointwise"
    candidate_inputs = [t.contiguous() for t in candidate_inputs]
    request_inputs = [t.contiguous() for t in request_inputs]
    idx = idx.contiguous()
    first = (candidate_inputs + request_inputs)[0]
    trailing = tuple(first.shape[1:])
    num_candidates = idx.shape[0]
    check_launch_device(idx, *candidate_inputs, *request_inputs)
    check_contiguous(op, **{f"c{i}": t for i, t in enumerate(candidate_inputs)})
    check_contiguous(op, **{f"r{i}": t for i, t in enumerate(request_inputs)})
    check_launch_dtypes(
        op, **{f"in{i}": t for i, t in enumerate(candidate_inputs + request_inputs)}
    )

    out = torch.empty((num_candidates, *trailing), dtype=first.dtype, device=first.device)
    numel = out.numel()
    if numel == 0:
        return out
    inner = numel // num_candidates
    kernel = get_kernel(program, len(candidate_inputs), len(request_inputs), first.dtype)
    # The interpreter pays per program, not per element: few large programs there.
    block = 4096 if interpreting() else 1024
    launch_opts = {} if interpreting() else {"num_warps": 4}
    grid = (triton.cdiv(numel, block),)
    kernel[grid](
        out, idx, *candidate_inputs, *request_inputs, numel, inner, BLOCK=block, **launch_opts
    )
    return out
