"""Keep freed memory in the process, so that page faults do not decide a timing.

glibc's ``malloc`` serves large blocks (from 128 KiB, a threshold it raises as blocks are freed)
with ``mmap`` and gives them back with ``munmap`` when freed, and trims the top of its heap once
enough of it is free. A model whose call allocates tens of megabytes (DIN at 1024 candidates:
about 100 MB in 40 ops) then touches fresh pages on every call, a minor page fault per 4 KiB
page (10,000 to 19,000 per call), which roughly doubles the call. Whether a process lands in that
mode depends on the order of earlier allocations, so the same program is fast in one run and
slow in the next, in eager and compiled calls alike.

:func:`retain_freed_memory` tells ``malloc`` to serve every block from its heap and never trim
it (``mallopt(M_MMAP_MAX, 0)``, ``mallopt(M_TRIM_THRESHOLD, 1 GiB)``), as a serving process
linked with jemalloc or tcmalloc keeps its pages: after the first calls no call faults, and the
timing measures the ops. It changes the process, not the programs being compared.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # <malloc.h>


def retain_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory; False where malloc is not glibc's."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))
