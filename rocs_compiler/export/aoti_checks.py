"""AOTInductor packages that check their inputs unless the serving process opts out.

AOTInductor compiles each input's dtype, sizes and strides into a package and reads every input
with the compiled strides, whatever tensor it is given: a strided view (``packed[:, 3:11]``) gives
wrong scores. The generated wrapper can compare each input with what was compiled and refuse one
that differs (``unmatched stride value at 0, expected: 8, but got: 16``), but only in a process
that sets ``AOTI_RUNTIME_CHECK_INPUTS=1``. While ``rocs.aoti_package`` compiles, this module
turns that default around in the generated C++: the check runs unless the process sets
``AOTI_RUNTIME_CHECK_INPUTS=0``.

Identity: the generated test ``v != nullptr && v[0] != '0'`` becomes
``v == nullptr || v[0] != '0'``, which gives the same answer whenever the variable is set and
true when it is not. A torch whose wrapper spells the test otherwise keeps its own default,
with one warning that says so.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator

OPT_IN = "env_var_value != nullptr && env_var_value[0] != '0'"
OPT_OUT = "env_var_value == nullptr || env_var_value[0] != '0'"
_LOCK = threading.Lock()


@contextlib.contextmanager
def input_checks_by_default() -> Iterator[None]:
    """Within the block, AOTInductor's C++ wrappers check their inputs unless told not to."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    original = CppWrapperCpu.generate_input_output_runtime_checks
    flipped = []

    def generate(self) -> None:
        lines = self.prefix._lines
        start = len(lines)
        original(self)
        for i in range(start, len(lines)):
            if isinstance(lines[i], str) and OPT_IN in lines[i]:
                lines[i] = lines[i].replace(OPT_IN, OPT_OUT)
                flipped.append(i)

    with _LOCK:
        CppWrapperCpu.generate_input_output_runtime_checks = generate
        try:
            yield
        finally:
            CppWrapperCpu.generate_input_output_runtime_checks = original
    if not flipped:
        warnings.warn(
            "rocs: this torch's AOTInductor wrapper was not recognized; the package checks its "
            "inputs only with AOTI_RUNTIME_CHECK_INPUTS=1 (pass contiguous inputs)",
            stacklevel=3,
        )
