"""The role lattice ``CONST < REQUEST < CANDIDATE``.

A node's role says how many rows its value has in the rewritten graph:

- ``CONST``: no batched input reaches it (weights, shapes of weights); computed once.
- ``REQUEST``: only request-side inputs reach it through row-wise ops; R rows, row r for request r.
- ``CANDIDATE``: everything else; N rows, exactly as the original model computed it.
"""

from __future__ import annotations

import enum


class Role(enum.IntEnum):
    CONST = 0
    REQUEST = 1
    CANDIDATE = 2

    def join(self, other: "Role") -> "Role":
        return Role(max(self, other))

    @staticmethod
    def join_all(roles) -> "Role":
        out = Role.CONST
        for role in roles:
            out = out.join(role)
        return out
