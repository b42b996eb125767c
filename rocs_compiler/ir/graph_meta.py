"""Names under which the pipeline's stages record facts on graph nodes, and the index input.

Every stage that reads or writes node metadata imports its keys from here, so no stage owns
another's vocabulary. Values are :class:`~rocs_compiler.ir.roles.Role` members throughout.

- ``ROLE``: a node's role in a logical graph (every node at batch size); written by the
  analysis driver only.
- ``REASON``: why a node that saw only request-side inputs runs per candidate; written with
  ``ROLE``.
- ``BATCH_AXIS``: on a REQUEST tensor value of a logical graph, where it holds the requests
  (a :class:`~rocs_compiler.analysis.batch_axis.BatchAxis`; a tuple of them, or None per item, for a
  tuple). Written with ``ROLE``.
- ``PLACEMENT``: where a node of the shared graph lives, as a role: ``CONST`` computed once,
  ``REQUEST`` at R rows, ``CANDIDATE`` at N rows. Written by *share*, and by the passes after it
  for the nodes they create. A node never reads a value placed higher than itself, except
  through ``INDEX_NAME``.
- ``BROADCAST``: on the ``index_select(x, dim, candidate_to_request)`` nodes that *share*
  inserts where a request value enters candidate computation, the batch axis of ``x`` (the
  gather is along its row dim; a merged axis is split by a reshape before and merged after).
- ``FOLD``: on a ``get_attr`` node that reads a folded constant, its
  :class:`~rocs_compiler.ir.folded.Fold` (the weight-only subgraph it was evaluated from). Written
  by *cleanup*; the runtime evaluates it again when a weight it reads changes.
- ``EAGER_LAYOUT``: on a dropout in training mode, the memory order of its input in eager (dims
  outermost first), which decides where its mask's draws land. Written at capture
  (``passes/random_layouts.py``) on training compiles.
"""

ROLE = "rocs_role"
REASON = "rocs_reason"
BATCH_AXIS = "rocs_batch_axis"
PLACEMENT = "rocs_placement"
BROADCAST = "rocs_broadcast"
FOLD = "rocs_fold"
EAGER_LAYOUT = "rocs_eager_layout"

# The shared graph's last input: int64 [N], the request row of every candidate.
INDEX_NAME = "candidate_to_request"
