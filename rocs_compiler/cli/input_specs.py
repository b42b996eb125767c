"""Example inputs from the command line: ``--input NAME=DTYPE[SHAPE]<K`` specs and the ragged
batches synthesized from them.

Notation (one ``--input`` per tensor the model's ``forward`` takes)::

    user_dense=float32[64]      float32 [B, 64], standard normal
    item_id=int64[]<5000        int64 [B], uniform in [0, 5000)
    history=int64[50]<10000     int64 [B, 50]
    features.age=float32[1]     a tensor inside the dict argument ``features``
    mask=bool[8]                random True/False

SHAPE excludes the batch dim, which every input has. DTYPE defaults to float32. ``<K`` bounds
integer ids (ids into an embedding table of K rows; default K = 2); it is refused for floats.

A batch for requests with ``counts[r]`` candidates each gives request inputs R = len(counts)
rows and candidate inputs N = sum(counts) rows (:class:`SpecBatch`, shared layout);
``replicated()`` is what the original model takes. The example batch of a compile is ragged,
``EXAMPLE_COUNTS``: requests with differing candidate counts, one of them a single candidate.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from ..errors import TargetError
from ..formats.names import covers

if TYPE_CHECKING:
    import torch

EXAMPLE_COUNTS = (3, 1, 5)
DEFAULT_ID_BOUND = 2
NOTATION = "NAME=DTYPE[SHAPE] or NAME=DTYPE[SHAPE]<K"
EXAMPLES = "user_dense=float32[64], 'item_id=int64[]<5000'"
_MAX_EXAMPLES = 6  # --input examples in a missing-input error

# spelling -> the torch dtype's name (torch is imported only when a spec is parsed, so that the
# parser of `rocs --help` does not import it)
_DTYPES = {
    "float32": "float32", "float": "float32", "f32": "float32",
    "float64": "float64", "double": "float64", "f64": "float64",
    "float16": "float16", "half": "float16", "f16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "int64": "int64", "long": "int64", "i64": "int64",
    "int32": "int32", "int": "int32", "i32": "int32",
    "int16": "int16", "int8": "int8", "uint8": "uint8",
    "bool": "bool",
}  # fmt: skip
_SPEC = re.compile(
    r"^(?P<name>[A-Za-z_][\w.]*)=(?P<dtype>[a-z0-9]*)\[(?P<shape>[\d,\s]*)\]"
    r"(?:<(?P<bound>\d+))?$"
)


@dataclass(frozen=True)
class InputSpec:
    """One input: its (dotted) name, dtype, shape without the batch dim, and id bound."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    bound: Optional[int] = None  # integer inputs: values in [0, bound)

    def sample(self, rows: int, generator: torch.Generator) -> torch.Tensor:
        import torch

        size = (rows, *self.shape)
        if self.dtype == torch.bool:
            return torch.randint(0, 2, size, generator=generator).bool()
        if self.dtype.is_floating_point:
            return torch.randn(size, generator=generator).to(self.dtype)
        high = self.bound or DEFAULT_ID_BOUND
        return torch.randint(0, high, size, generator=generator, dtype=self.dtype)


def parse_spec(text: str) -> InputSpec:
    """``"item_id=int64[]<5000"`` -> :class:`InputSpec`; ValueError says what is wrong."""
    match = _SPEC.match(text.strip())
    if match is None:
        raise ValueError(f"expected {NOTATION} (e.g. {EXAMPLES}), got {text!r}")
    dtype_name = match["dtype"] or "float32"
    if dtype_name not in _DTYPES:
        raise ValueError(
            f"{text!r}: unknown dtype {dtype_name!r} (one of {', '.join(sorted(_DTYPES))})"
        )
    import torch

    dtype = getattr(torch, _DTYPES[dtype_name])
    shape = tuple(int(d) for d in match["shape"].replace(" ", "").split(",") if d)
    bound = int(match["bound"]) if match["bound"] is not None else None
    if bound is not None and (dtype.is_floating_point or dtype == torch.bool):
        raise ValueError(f"{text!r}: <K bounds integer ids; {dtype_name} takes no bound")
    if bound is not None and bound < 1:
        raise ValueError(f"{text!r}: the id bound K must be at least 1")
    return InputSpec(match["name"], dtype, shape, bound)


def check_specs(model: torch.nn.Module, specs: Sequence[InputSpec], label: str) -> None:
    """Raise :class:`TargetError` naming forward's arguments without a spec, or specs that name
    no argument of forward."""
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise TargetError(f"--input given twice for: {', '.join(duplicates)}")
    params = inspect.signature(model.forward).parameters.values()
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params)
    named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    given = {n.split(".")[0] for n in names}
    unknown = sorted(given - {p.name for p in named}) if not takes_any else []
    if unknown:
        raise TargetError(
            f"--input {', '.join(unknown)}: {label}'s forward has no such argument "
            f"(its arguments: {', '.join(p.name for p in named) or 'none'})"
        )
    missing = [p.name for p in named if p.default is p.empty and p.name not in given]
    if missing:
        from .input_hints import suggested_specs

        examples = [spec for name in missing for spec in suggested_specs(model, name)]
        raise TargetError(
            f"{label}: no --input for {', '.join(missing)} (forward takes "
            f"{', '.join(p.name for p in named)}); give one --input NAME=DTYPE[SHAPE] per "
            "tensor (NAME.KEY=... inside a dict argument), e.g. "
            + " ".join(f"--input '{spec}'" for spec in examples[:_MAX_EXAMPLES])
        )


def check_requests(specs: Sequence[InputSpec], request_inputs: Sequence[str]) -> None:
    """Every request name must cover at least one spec (a name or a dict argument)."""
    names = [s.name for s in specs]
    for request in request_inputs:
        if not any(covers(request, n) for n in names):
            raise TargetError(
                f"--request {request}: no --input by that name (inputs: {', '.join(names)})"
            )


def _is_request(name: str, request_inputs: Sequence[str]) -> bool:
    return any(covers(r, name) for r in request_inputs)


def _set(tree: dict, dotted: str, value: torch.Tensor) -> None:
    *path, last = dotted.split(".")
    for key in path:
        tree = tree.setdefault(key, {})
    tree[last] = value


@dataclass
class SpecBatch:
    """A shared-layout batch: request leaves R rows, candidate leaves N rows (dotted names)."""

    leaves: dict[str, torch.Tensor]
    candidate_to_request: torch.Tensor
    request_inputs: tuple[str, ...]

    def _nested(self, leaves: dict[str, torch.Tensor]) -> dict:
        out: dict = {}
        for name, value in leaves.items():
            _set(out, name, value)
        return out

    @property
    def kwargs(self) -> dict:
        return self._nested(self.leaves)

    def replicated(self) -> dict:
        """The original model's inputs: request leaves gathered to N rows."""
        index = self.candidate_to_request
        return self._nested(
            {
                n: v.index_select(0, index) if _is_request(n, self.request_inputs) else v
                for n, v in self.leaves.items()
            }
        )


def request_index(counts: Sequence[int]) -> torch.Tensor:
    """``candidate_to_request`` for requests with ``counts[r]`` candidates each, grouped."""
    import torch

    return torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(list(counts)))


def spec_batch(
    specs: Sequence[InputSpec], request_inputs: Sequence[str], counts: Sequence[int], seed: int = 0
) -> SpecBatch:
    """Random inputs following ``specs`` for requests with ``counts[r]`` candidates each."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    num_requests, num_candidates = len(counts), sum(counts)
    leaves = {
        s.name: s.sample(
            num_requests if _is_request(s.name, request_inputs) else num_candidates, generator
        )
        for s in specs
    }
    return SpecBatch(leaves, request_index(counts), tuple(request_inputs))
