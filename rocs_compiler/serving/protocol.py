"""The HTTP JSON protocol (docs/serving.md), without the server.

- ``POST /score`` with ``{"request": {name: row}, "candidates": {name: [rows]}}`` answers
  ``{"scores": outputs}``: the model's outputs for that request's candidates, nested as the model
  returns them (a tensor as nested lists, a dict as an object, a tuple as a list).
- ``GET /healthz`` answers ``{"status": "ok"}``; ``GET /info`` the model, its inputs with dtypes
  and shapes, its request inputs and the batch settings.
- Errors answer ``{"error": one line, "field": name or null}``: 400 for bad input, 413 for a body
  over the size limit, 503 with ``Retry-After`` when the queue is full, 404 for another path.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from .schema import RequestError

ROUTES = {("POST", "/score"), ("GET", "/healthz"), ("GET", "/info")}


def decode(body: bytes, limit: int) -> Any:
    """The JSON value of a request body of at most ``limit`` bytes."""
    check_size(len(body), limit)
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RequestError(f"malformed JSON: {err}", "body") from None


def check_size(size: int | None, limit: int) -> None:
    if size is not None and size > limit:
        raise RequestError(f"body of {size} bytes is over the limit of {limit} bytes", "body", 413)


def to_json(value: Any) -> Any:
    """Outputs as JSON values: tensors as (nested) lists, containers element by element."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return _nulls(value.tolist())
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def _nulls(value: Any) -> Any:
    """Nested lists of floats with every NaN or infinity as None."""
    if isinstance(value, list):
        return [_nulls(v) for v in value]
    return value if math.isfinite(value) else None


def scores(outputs: Any) -> dict:
    return {"scores": to_json(outputs)}


def error(message: str, field: str | None = None) -> dict:
    return {"error": " ".join(str(message).split()), "field": field}


def request_error(err: RequestError) -> dict:
    return error(str(err), err.field)
