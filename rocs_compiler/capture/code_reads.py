"""What the model's own Python code reads outside its modules, recorded during one eager call.

Export bakes into the graph every value the traced Python code reads: a module-level constant
(``x * SCALE``), a field of a config object (``self.cfg.scale``), a class attribute
(``type(self).K``). :func:`code_recording` runs a call under a profile function that sees every
Python frame the call enters; for each frame of the model's own code (not torch's, the standard
library's or this package's) it notes the globals dictionary and the names the code loads from it
(``LOAD_GLOBAL``), and the attribute names the code reads (``LOAD_ATTR``/``LOAD_METHOD``, and
string constants, for ``getattr(obj, "name")``). ``runtime/follow/read_guards.py`` turns the record into
per-call checks: a global's value, and the attributes of those names on the objects forward holds.

Identity relied on: the example call runs the same Python code export traces. The names are read
from the code objects, so they are a superset of what one call read (a branch not taken counts):
a check too many, never one too few. A global the code also assigns (``global n; n += 1``) is the
model's own state, not an input, and is left out.

Not seen: names read through closures (``nonlocal``), by ``exec``/``eval`` text, or through
dynamically built attribute names; and everything while another, non-Python profiler (cProfile)
is installed.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import os
import sys
import sysconfig
import types
from dataclasses import dataclass, field
from typing import Any, Iterator

# Packages whose code reads its own globals, never the model's.
LIBRARIES = ("torch", "rocs_compiler", "torchrec", "fbgemm_gpu", "triton", "numpy", "sympy")
_GLOBAL_LOADS = {"LOAD_GLOBAL", "LOAD_NAME"}
_GLOBAL_STORES = {"STORE_GLOBAL", "DELETE_GLOBAL"}
_ATTRIBUTE_LOADS = {"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"}


@dataclass
class CodeReads:
    """Globals (per globals dictionary) and attribute names read by the model's own code."""

    globals: dict[int, tuple[dict, set[str]]] = field(default_factory=dict)  # id -> (dict, names)
    attribute_names: set[str] = field(default_factory=set)
    stored: set[tuple[int, str]] = field(default_factory=set)  # (id of globals, name) assigned

    def global_reads(self) -> Iterator[tuple[dict, str]]:
        """Each (globals dictionary, name) read and not assigned by the model's code."""
        for key, (namespace, names) in self.globals.items():
            for name in sorted(names):
                if (key, name) not in self.stored and not name.startswith("__"):
                    yield namespace, name


def library_file(filename: str) -> bool:
    """True for a file of the standard library or of a package in ``LIBRARIES``."""
    packages, stdlib = _library_prefixes(tuple(name in sys.modules for name in LIBRARIES))
    if filename.startswith(packages):
        return True
    return filename.startswith(stdlib) and "-packages" not in filename


def library_object(obj: Any) -> bool:
    """True for a module or class defined by the standard library or a package of
    ``LIBRARIES`` (their attributes are code, not the model's settings)."""
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", "")
    name = name if isinstance(name, str) else ""
    if name.split(".")[0] in LIBRARIES or name in sys.builtin_module_names:
        return True
    filename = getattr(sys.modules.get(name), "__file__", None)
    return isinstance(filename, str) and library_file(filename)


@functools.cache
def _library_prefixes(imported: tuple[bool, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(folders of the packages of ``LIBRARIES`` imported so far, the standard library's);
    ``imported`` says which are, the cache key."""
    packages = []
    for name in LIBRARIES:
        packages += [os.path.join(p, "") for p in getattr(sys.modules.get(name), "__path__", ())]
    paths = sysconfig.get_paths()
    stdlib = {os.path.join(paths[k], "") for k in ("stdlib", "platstdlib")}
    return tuple(packages), (*stdlib, "<frozen")


def _code_facts(code: types.CodeType) -> tuple[set[str], set[str], set[str]] | None:
    """(global names loaded, attribute names read, global names assigned) of one code object,
    or None for library code."""
    if library_file(code.co_filename):
        return None
    loads, attributes, stores = set(), set(), set()
    for instruction in dis.get_instructions(code):
        if instruction.opname in _GLOBAL_LOADS:
            loads.add(instruction.argval)
        elif instruction.opname in _ATTRIBUTE_LOADS:
            attributes.add(instruction.argval)
        elif instruction.opname in _GLOBAL_STORES:
            stores.add(instruction.argval)
    attributes.update(c for c in code.co_consts if isinstance(c, str) and c.isidentifier())
    return loads, attributes, stores


@contextlib.contextmanager
def code_recording() -> Iterator[CodeReads]:
    """Record, while the block runs, what this thread's frames of non-library code read.

    Chains to a Python profile function already installed; under a C-level one (cProfile) it
    records nothing."""
    reads = CodeReads()
    previous = sys.getprofile()
    if previous is not None and not isinstance(previous, types.FunctionType):
        yield reads
        return
    facts_of: dict[types.CodeType, Any] = {}

    def profile(frame, event, arg):
        if previous is not None:
            previous(frame, event, arg)
        if event != "call":
            return
        code = frame.f_code
        facts = facts_of.get(code, False)
        if facts is False:
            facts = facts_of[code] = _code_facts(code)
        if facts is None:
            return
        loads, attributes, stores = facts
        namespace = frame.f_globals
        reads.globals.setdefault(id(namespace), (namespace, set()))[1].update(loads)
        reads.attribute_names.update(attributes)
        reads.stored.update((id(namespace), name) for name in stores)

    sys.setprofile(profile)
    try:
        yield reads
    finally:
        sys.setprofile(previous)
