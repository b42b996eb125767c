"""The Ray Serve deployment: requests checked one by one, packed into shared-layout calls.

Each request is checked against the model's fields on arrival (``schema.py``); only a good
request joins a batch, so a bad one answers 400 alone. ``@serve.batch`` gathers waiting
requests up to ``max_batch_candidates`` candidates in all (its ``batch_size_fn``) and
``max_batch_requests`` requests, for at most ``batch_wait_ms``; a request with more candidates
than the cap runs alone. A batch runs on the replica's one compute thread (the event loop stays
free to answer health checks and refuse overload): pack, one call, split. Should the call fail,
each request of the batch runs alone, so only the request the model fails on gets the error.

Overload: a replica holds at most ``max_queued`` requests; beyond, it answers 503 with
``Retry-After`` at once (and Serve's own ``max_queued_requests`` bounds what waits in front of
the replicas). A replica that dies fails its in-flight requests at once (Serve's proxy answers
HTTP 500 in plain text, a handle call raises ``ray.exceptions.ActorDiedError``); Serve finds it
dead at its next health check (every ``HEALTH_CHECK_S``) and starts another, while new requests
wait in Serve's queue for a live replica.

Two entry points per replica: HTTP (``__call__``: ``POST /score``, ``GET /healthz``,
``GET /info``; ``protocol.py``) and the Python path for callers inside the Ray cluster,
``handle.score.remote({"request": ..., "candidates": ...})`` with tensors, NumPy arrays or lists,
answered with the model's outputs as tensors.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray import serve
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from . import launch, protocol
from .packing import pack, split
from .schema import Request, RequestError
from .settings import ServeSettings

_OVER_CAP = 2**62  # a batch size no cap admits
HEALTH_CHECK_S = 2.0  # how often Serve checks that a replica is alive


class Overloaded(RuntimeError):
    """The replica holds ``max_queued`` requests already: try again after ``retry_after_s``."""


class _Queued:
    """A checked request waiting for a batch, with the request cap of its deployment."""

    __slots__ = ("max_requests", "request")

    def __init__(self, request: Request, max_requests: int):
        self.request = request
        self.max_requests = max_requests


def _batch_size(items: list) -> int:
    """Total candidates of a batch; over any cap once it holds too many requests."""
    if len(items) > items[0].max_requests:
        return _OVER_CAP
    return sum(item.request.num_candidates for item in items)


class _Failed:
    """One request's error inside a batch's results."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class Scorer:
    """A served model in one replica (wrapped by :func:`deployment`)."""

    def __init__(self, source: Any, settings: ServeSettings | None = None, name: str | None = None):
        import torch

        from .served import served_model

        launch.loopback_replica()
        self.settings = settings = settings or ServeSettings()
        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        self.model = served_model(source, name)
        self.schema = self.model.schema
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rocs-serve")
        self._held = 0
        self._batches = 0
        self._recent: deque = deque(maxlen=64)  # candidates per request of the latest batches
        self._timings = Timings()
        self._batch.set_max_batch_size(settings.max_batch_candidates)
        self._batch.set_batch_wait_timeout_s(settings.batch_wait_ms / 1000)

    # -- entry points ----------------------------------------------------------------------------

    async def __call__(self, http: HTTPRequest) -> JSONResponse:
        method, path = http.method, _route(http)
        if (method, path) == ("GET", "/healthz"):
            return JSONResponse({"status": "ok"})
        if (method, path) == ("GET", "/info"):
            return JSONResponse(self.info())
        if (method, path) != ("POST", "/score"):
            known = ", ".join(f"{m} {p}" for m, p in sorted(protocol.ROUTES))
            return JSONResponse(protocol.error(f"no route {method} {path}; routes: {known}"), 404)
        try:
            length = http.headers.get("content-length")
            protocol.check_size(
                int(length) if length and length.isdigit() else None, self.settings.body_limit
            )
            payload = protocol.decode(await http.body(), self.settings.body_limit)
            outputs = await self._score(payload)
        except RequestError as err:
            return JSONResponse(protocol.request_error(err), err.status)
        except Overloaded as err:
            headers = {"Retry-After": str(self.settings.retry_after_s)}
            return JSONResponse(protocol.error(str(err)), 503, headers=headers)
        return JSONResponse(protocol.scores(outputs))

    async def score(self, payload: Any) -> Any:
        """The Python path: the model's outputs for one request, as tensors."""
        return await self._score(payload)

    def stats(self, reset: bool = False) -> dict:
        """Batches run so far, the candidate counts of the latest ones, and where the replica's
        time goes (:class:`Timings`; tests, benchmarks); ``reset`` starts the timings afresh."""
        stats = {
            "batches": self._batches,
            "recent": list(self._recent),
            "held": self._held,
            **self._timings.summary(),
        }
        if reset:
            self._timings = Timings()
            self._recent.clear()
        return stats

    def info(self) -> dict:
        return {
            **self.model.info(),
            "plain": self.settings.plain,
            "batch": self.settings.describe(),
        }

    # -- scoring ---------------------------------------------------------------------------------

    async def _score(self, payload: Any) -> Any:
        settings = self.settings
        if self._held >= settings.max_queued:
            raise Overloaded(
                f"the server holds {self._held} requests (max_queued {settings.max_queued}); "
                f"retry after {settings.retry_after_s} s"
            )
        self._held += 1
        start = time.perf_counter()
        try:
            request = self.schema.check(payload)
            request.meta["check_s"] = time.perf_counter() - start
            if request.num_candidates > settings.max_batch_candidates:
                loop = asyncio.get_running_loop()
                result = (await loop.run_in_executor(self._pool, self._run, [request]))[0]
            else:
                result = await self._batch(_Queued(request, settings.max_batch_requests))
        finally:
            self._held -= 1
        self._timings.replica.append(time.perf_counter() - start)
        if isinstance(result, _Failed):
            raise result.error
        return result

    @serve.batch(max_batch_size=8192, batch_wait_timeout_s=0.002, batch_size_fn=_batch_size)
    async def _batch(self, items: list[_Queued]) -> list:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._run, [i.request for i in items])

    def _run(self, requests: list[Request]) -> list:
        """Outputs per request of one packed call; if it fails, each request alone."""
        try:
            return self._call(requests)
        except Exception as err:  # noqa: BLE001 - answered per request below
            if len(requests) == 1:
                return [_Failed(_model_error(err))]
        results = []
        for request in requests:
            try:
                results.extend(self._call([request]))
            except Exception as err:  # noqa: BLE001
                results.append(_Failed(_model_error(err)))
        return results

    def _call(self, requests: list[Request]) -> list:
        start = time.perf_counter()
        packed = pack(self.schema, requests)
        self._batches += 1
        self._recent.append(packed.counts)
        packed_at = time.perf_counter()
        scores = self.model(packed, plain=self.settings.plain)
        called_at = time.perf_counter()
        outputs = split(scores, packed.counts)
        checks = sum(r.meta.get("check_s", 0.0) for r in requests)
        self._timings.batch(
            outside=checks + (packed_at - start) + (time.perf_counter() - called_at),
            model=called_at - packed_at,
            candidates=packed.num_candidates,
        )
        return outputs


class Timings:
    """Where a replica's time goes, over its latest 1024 requests and batches:

    - ``replica``: per request, from its arrival to its outputs (check, batch wait, the batch's
      run, split);
    - per batch, ``model``: the model call alone; ``outside``: the rest of the replica's own work
      on it (its requests' checks, packing, splitting; not the batch wait);
    - ``model_s`` and ``candidates``: totals since the last reset (the model's time per
      candidate)."""

    def __init__(self):
        self.replica: deque = deque(maxlen=1024)
        self.model: deque = deque(maxlen=1024)
        self.outside: deque = deque(maxlen=1024)
        self.model_s, self.candidates = 0.0, 0

    def batch(self, outside: float, model: float, candidates: int) -> None:
        self.outside.append(outside)
        self.model.append(model)
        self.model_s += model
        self.candidates += candidates

    def summary(self) -> dict:
        return {
            "replica_ms_p50": 1000 * _median(self.replica),
            "call_ms_p50": 1000 * _median(self.model),
            "outside_ms_p50": 1000 * _median(self.outside),
            "model_s": self.model_s,
            "candidates": self.candidates,
        }


def _median(values) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


def _route(http: HTTPRequest) -> str:
    """The request's path below the application's route prefix."""
    path, prefix = http.url.path, http.scope.get("root_path", "").rstrip("/")
    if prefix and path.startswith(prefix):
        path = path[len(prefix) :]
    return path.rstrip("/") or "/"


def _model_error(err: Exception) -> Exception:
    """A failure of the model on one request: bad input answers 400 (ids out of range that the
    check could not see: an AOTInductor package's compiled bounds check raises a RuntimeError
    "index out of bounds: ...")."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    bounds = isinstance(err, RuntimeError) and first.startswith("index out of bounds")
    if bounds or isinstance(err, (ValueError, IndexError, TypeError)):
        return RequestError(f"the model refused this request: {type(err).__name__}: {first}")
    return err


def deployment(
    source: Any,
    settings: ServeSettings | None = None,
    *,
    name: str = "rocs",
    replicas: int = 1,
    model_name: str | None = None,
):
    """A Serve application scoring with ``source`` (a path to a saved program, or a no-argument
    factory returning a compiled model or a loaded program: it runs in each replica)."""
    settings = settings or ServeSettings()
    ongoing = settings.max_queued + 16  # past it, Serve queues in front of the replicas
    options = {
        "name": name,
        "num_replicas": replicas,
        "max_ongoing_requests": ongoing,
        # Serve's own bound on what waits for a replica; a burst passes through it briefly, so
        # it is looser than the replicas' (which answer with Retry-After and a JSON error).
        "max_queued_requests": max(64, 2 * settings.max_queued * max(replicas, 1)),
        "ray_actor_options": {"num_cpus": settings.replica_cpus},
        # On shutdown a replica finishes its requests (they take milliseconds): checked often,
        # given up after a few seconds.
        "graceful_shutdown_wait_loop_s": 0.2,
        "graceful_shutdown_timeout_s": 5.0,
        # Serve notices a dead replica at its next health check and only then starts another;
        # its default period (10 s) would hold requests in Serve's queue that much longer.
        "health_check_period_s": HEALTH_CHECK_S,
    }
    return serve.deployment(Scorer).options(**options).bind(source, settings, model_name)
