"""The server's settings: batch cap and wait, queue bound, body limit, threads (no Ray here)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import OptionsError


@dataclass(frozen=True)
class ServeSettings:
    """How one deployment batches and bounds its work.

    - ``max_batch_candidates``: a batch holds whole requests up to this many candidates in all;
      a request with more runs alone.
    - ``max_batch_requests``: and at most this many requests (1: no batching across requests).
    - ``batch_wait_ms``: how long the first request of a batch waits for others.
    - ``max_queued``: requests one replica holds (waiting or running) before it answers 503 with
      ``Retry-After: retry_after_s``.
    - ``body_limit``: the largest HTTP body in bytes (413 beyond).
    - ``threads``: torch's intra-op threads per replica (None: torch's default).
    - ``plain``: serve the original model on replicated rows with the same packing (a baseline).
    - ``replica_cpus``: CPUs Ray reserves per replica.
    """

    max_batch_candidates: int = 8192
    max_batch_requests: int = 64
    batch_wait_ms: float = 2.0
    max_queued: int = 256
    retry_after_s: int = 1
    body_limit: int = 32 * 2**20
    threads: int | None = None
    plain: bool = False
    replica_cpus: float = 1.0

    def __post_init__(self):
        problems = []
        for name in (
            "max_batch_candidates",
            "max_batch_requests",
            "max_queued",
            "body_limit",
            "retry_after_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.batch_wait_ms, (int, float)) or self.batch_wait_ms < 0:
            problems.append(f"batch_wait_ms must be a number >= 0, got {self.batch_wait_ms!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            problems.append(f"threads must be an integer >= 1 or None, got {self.threads!r}")
        if not isinstance(self.replica_cpus, (int, float)) or self.replica_cpus < 0:
            problems.append(f"replica_cpus must be a number >= 0, got {self.replica_cpus!r}")
        if problems:
            valid = ", ".join(f.name for f in dataclasses.fields(self))
            raise OptionsError("serve settings", problems, f"settings: {valid}")

    def describe(self) -> dict:
        return dataclasses.asdict(self)
