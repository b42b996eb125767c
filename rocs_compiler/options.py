"""Compiler options as typed, frozen values, validated where they enter.

:class:`Options` holds the pipeline switches of ``rocs.compile``; :class:`BackendOptions` adds what
only the ``torch.compile`` backend does with the result. Every entry point (``rocs.compile``, the
backend, the CLI's ``--options``) turns what the user passed into one of them with
:meth:`Options.from_mapping`, before any compile work, so a typo or a wrong type is an error that
lists the valid options instead of a switch silently left at its default.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Self, Union

from .errors import OptionsError


# The values of ``Options.request_dropout`` (docs/contract.md, "Autograd": randomness).
REQUEST_DROPOUT = ("per_impression", "per_request")


def _option(default: Any, doc: str) -> Any:
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class Options:
    """Pipeline options: ``rocs.compile(..., options=rocs.Options(defer=False))`` or a dict."""

    defer: bool = _option(True, "split linear maps over request/candidate concatenations")
    float32_partials: bool = _option(
        True, "float16/bfloat16 contractions split by defer sum float32 partials, rounded once"
    )
    ikbo: bool = _option(True, "fuse broadcasts of request rows into IKBO kernels")
    ikbo_pointwise: Optional[bool] = _option(
        None, "fuse elementwise chains into generated kernels; None: on for GPU models"
    )
    capture_strict: bool = _option(True, "if non-strict torch.export fails, try strict export")
    autotune: bool = _option(
        True, "time the shared and the plain program per call-size bucket, keep the faster"
    )
    training: bool = _option(
        False,
        "compile for training: capture the model's mode as it is, fold no weights, and backward "
        "through the model's own parameters (rocs.compile(..., training=True))",
    )

    jagged: bool = _option(
        True,
        "run a shared-layout call whose histories are padded past most requests' lengths as "
        "groups of requests cut to their lengths, where the model provably ignores the padding",
    )
    request_dropout: str = _option(
        "per_impression",
        "training: 'per_impression' draws dropout on request-side values once per impression, "
        "as eager; 'per_request' draws once per request (more sharing; a change of the model)",
    )

    def __post_init__(self):
        where = f"{type(self).__name__}(...)"
        _check(type(self), dataclasses.asdict(self), where)
        if self.request_dropout not in REQUEST_DROPOUT:
            raise OptionsError(
                where,
                [f"option 'request_dropout' must be one of {', '.join(map(repr, REQUEST_DROPOUT))}"
                 f", got {self.request_dropout!r}"],
                type(self).describe(),
            )  # fmt: skip

    @classmethod
    def from_mapping(
        cls, options: Union[Mapping[str, Any], Options, None], *, where: str = "rocs.compile"
    ) -> Self:
        """``options`` as a ``cls``: None gives the defaults, a ``cls`` value is returned as is.

        Raises :class:`OptionsError` naming ``where`` (the entry point) for an unknown key or a
        value of the wrong type (a bool option takes only ``True`` or ``False``).
        """
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, Mapping):
            problem = f"options must be a dict or {cls.__name__}, got {type(options).__name__}"
            raise OptionsError(where, [problem], cls.describe())
        _check(cls, options, where)
        try:
            return cls(**options)
        except OptionsError as err:  # a value the type admits but the option does not
            raise OptionsError(where, err.problems, err.valid) from None

    @classmethod
    def describe(cls, one_line: bool = False) -> str:
        """The valid options, one per line: name, type, default and what it does.

        ``one_line``: names, types and defaults on one line (for the CLI's one-line errors).
        """
        hints = typing.get_type_hints(cls)
        rows = [
            (f"{f.name}: {_type_name(hints[f.name])} = {f.default!r}", f.metadata["doc"])
            for f in dataclasses.fields(cls)
        ]
        if one_line:
            return "valid options: " + ", ".join(head for head, _ in rows)
        width = max(len(head) for head, _ in rows)
        return "valid options:\n" + "\n".join(f"  {head:<{width}}  {doc}" for head, doc in rows)


@dataclass(frozen=True)
class BackendOptions(Options):
    """Options of the ``torch.compile`` backend: the pipeline options and how the result runs."""

    capture_strict: bool = _option(False, "try strict export too; off, as it resets dynamo")
    inductor: bool = _option(True, "lower the rewritten graph with Inductor")


def _check(cls: type, options: Mapping[str, Any], where: str) -> None:
    hints = typing.get_type_hints(cls)
    problems = []
    for key, value in options.items():
        if key not in hints:
            close = difflib.get_close_matches(str(key), list(hints), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"unknown option {key!r}{hint}")
        elif not _accepts(hints[key], value):
            problems.append(
                f"option {key!r} must be {_type_name(hints[key])}, "
                f"got {value!r} ({type(value).__name__})"
            )
    if problems:
        raise OptionsError(where, problems, cls.describe())


def _accepts(hint: Any, value: Any) -> bool:
    if typing.get_origin(hint) is Union:
        return any(_accepts(arm, value) for arm in typing.get_args(hint))
    return type(value) is hint  # exact: a bool option takes neither 1 nor "yes"


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is Union:
        return " or ".join(_type_name(arm) for arm in typing.get_args(hint))
    return "None" if hint is type(None) else hint.__name__
