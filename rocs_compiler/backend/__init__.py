"""The ``torch.compile`` door: ``torch.compile(model, backend="rocs")`` (the entry point
``rocs_compiler.backend:rocs_backend``), its dynamo-graph reading and Inductor lowering."""

from .door import backend, rocs_backend, shared_call

__all__ = ["backend", "rocs_backend", "shared_call"]
