"""``rocs::broadcast_attention`` in plain torch with each request's keys and values read per
request: the form portable programs run (``export/portable.py``). The op's reference gathers them
once per candidate instead (``k[idx]``, ``v[idx]``: ``[N, H, L, D]``).

Axis letters: R requests, N candidates, H heads, Lq query length, L key length, D feature.

Identity: attention is row-wise in its queries. A query attends to a set of keys in the same way
whether it is alone or stacked with other queries against the same keys, so the candidates of a
request become the rows of a *tile*, one query sequence against that request's K/V, and all tiles
run as one batched attention ``[tiles, H, rows * Lq, D]``. Rows of a tile that hold no candidate
are zero queries, computed and never read back.

Every size is a function of R and N, never of the index's values, so the program exports with
dynamic R and N, compiles with AOTInductor and exports to ONNX. A tile has ``T = ceil(N / R)``
candidate rows plus one spare row: a width of at least 2 for every R and N, which spares the
exported program a guard ``T != 1``. A request's candidates take the rows of its tiles in index
order.

- **fits** (no request has more than T candidates: R = 1, equal counts, one candidate each):
  request r's candidates fill tile r, which attends to ``k[r]``, ``v[r]`` in place. R tiles, no
  gather of keys or values.
- **spills** (some request has more): a request's candidates beyond its first T fill extra tiles
  of T rows, numbered in request order, whose keys and values are gathered (``[R, H, L, D]``).
  R extra tiles always suffice: request r needs ``ceil(c_r / T) - 1 <= (c_r - 1) / T`` of them,
  which sum to at most ``(N - 1) / T < R``.

Which case holds depends on the index's values, so a traced program (export, torch.compile) holds
both as the branches of a ``torch.cond``; an eager call, or a trace whose R is a number, takes its
branch in Python.

- **one request** (R = 1, the common serving call): every candidate attends ``k[0]``, ``v[0]``, so
  the candidates' queries are one sequence of ``N Lq`` rows against them, one attention with no
  ranks, tiles or gathers. A traced program tests ``R == 1`` in a ``torch.cond`` of its own, ahead
  of the tiles.

Cost: keys and values are read in place once per request, plus a gather of R rows when a request
spills; never N rows. Queries are padded to ``R (T + 1) Lq`` rows (about N Lq), twice that when a
request spills.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def candidate_ranks(
    candidate_to_request: torch.Tensor, num_requests: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rank [N], counts [R])``: each candidate's position among its request's candidates, in
    index order, and each request's number of candidates."""
    num_candidates = candidate_to_request.shape[0]
    position = torch.arange(num_candidates, device=candidate_to_request.device)
    # The keys are distinct, so any sort (ONNX's TopK too) keeps a request's candidates in order.
    order = torch.argsort(candidate_to_request * num_candidates + position)
    ones = torch.ones_like(candidate_to_request)
    counts = torch.zeros(num_requests, dtype=ones.dtype, device=ones.device)
    counts = counts.index_add(0, candidate_to_request, ones)
    first = torch.cumsum(counts, 0) - counts  # each request's first position in sorted order
    sorted_requests = candidate_to_request.index_select(0, order)
    sorted_ranks = position - first.index_select(0, sorted_requests)
    return torch.empty_like(candidate_to_request).scatter(0, order, sorted_ranks), counts


def tile_rows_for(num_candidates: int, num_requests: int) -> int:
    """``T = ceil(N / R)``, the candidate rows of a tile (0 when there is no candidate)."""
    return (num_candidates - 1) // num_requests + 1


def _tile_and_row(
    candidate_to_request: torch.Tensor,
    rank: torch.Tensor,
    counts: torch.Tensor,
    tile_rows: int,
    spills: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile and the row in it of every candidate (the module docstring's layout)."""
    if not spills:
        return candidate_to_request, rank
    num_requests = counts.shape[0]
    extra_tiles = torch.clamp((counts - 1) // tile_rows, min=0)
    first_extra = num_requests + torch.cumsum(extra_tiles, 0) - extra_tiles
    beyond = rank - tile_rows
    extra = beyond // tile_rows
    own = rank < tile_rows
    extra_tile = first_extra.index_select(0, candidate_to_request) + extra
    tile = torch.where(own, candidate_to_request, extra_tile)
    return tile, torch.where(own, rank, beyond - extra * tile_rows)


def _attention(
    queries: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float | None,
    key_bias: torch.Tensor | None,
) -> torch.Tensor:
    """``queries [G, W, H, D]`` of tile g against ``k[g]``, ``v[g]``: ``[G, W, H, D]``."""
    mask = key_bias
    if mask is None and key_mask is not None:
        mask = key_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def _attend_in_tiles(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    candidate_to_request: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float | None,
    key_bias: torch.Tensor | None,
    rank: torch.Tensor,
    counts: torch.Tensor,
    spills: bool,
) -> torch.Tensor:
    """The op's value, computed in the layout ``spills`` names (module docstring)."""
    num_candidates, heads, query_len, dim = q.shape
    num_requests = k.shape[0]
    tile_rows = tile_rows_for(num_candidates, num_requests)
    tile, row = _tile_and_row(candidate_to_request, rank, counts, tile_rows, spills)
    # Query j of candidate n is row n * Lq + j of ``queries``; the last row is a zero query.
    queries = q.transpose(1, 2).reshape(num_candidates * query_len, heads, dim)
    queries = torch.cat([queries, q.new_zeros(1, heads, dim)])
    query = torch.arange(query_len, device=q.device)
    query_rows = (torch.arange(num_candidates, device=q.device) * query_len)[:, None] + query
    columns = row[:, None] * query_len + query  # [N, Lq]
    tiles = tile[:, None].expand(num_candidates, query_len)
    num_tiles = 2 * num_requests if spills else num_requests
    # Which row of ``queries`` each row of each tile holds; the + 1 is the spare row.
    tile_queries = torch.full(
        (num_tiles, (tile_rows + 1) * query_len),
        num_candidates * query_len,
        dtype=query_rows.dtype,
        device=q.device,
    ).index_put((tiles, columns), query_rows)
    out = _attention(queries[tile_queries[:num_requests]], k, v, key_mask, scale, key_bias)
    if spills:
        # Every candidate of a tile writes the tile's request: duplicates write the same value.
        tile_request = torch.zeros(num_tiles, dtype=query_rows.dtype, device=q.device)
        tile_request = tile_request.index_put((tile,), candidate_to_request)[num_requests:]
        extra_k, extra_v, extra_mask, extra_bias = (
            None if t is None else t.index_select(0, tile_request)
            for t in (k, v, key_mask, key_bias)
        )
        extra = _attention(
            queries[tile_queries[num_requests:]], extra_k, extra_v, extra_mask, scale, extra_bias
        )
        out = torch.cat([out, extra])
    # Contiguous strides, size-1 dims included: a cond's branches must agree on them.
    return out[tiles, columns].transpose(1, 2).clone(memory_format=torch.contiguous_format)


def _only_row(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` of one row as ``[1, ...]``, with a size of 1 a tracer can read (``t[:1]`` has
    ``min(1, R)`` rows to a tracer, which an unbacked R cannot decide; ``t[0]`` has none)."""
    return None if t is None else t.select(0, 0).unsqueeze(0)


def _one_request_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float | None,
    key_bias: torch.Tensor | None,
) -> torch.Tensor:
    """The op's value when ``k`` holds one request: every query attends ``k[0]``, ``v[0]``, as
    one sequence of the candidates' ``N Lq`` queries (heads first: ``[1, H, N Lq, D]``)."""
    num_candidates, heads, query_len, dim = q.shape
    rows = num_candidates * query_len
    # Two spare zero queries, computed and never read: a sequence of at least 2 rows, which
    # spares a tracer the question whether the mask's one row broadcasts against 1 query.
    queries = q.permute(1, 0, 2, 3).reshape(heads, rows, dim)
    queries = torch.cat([queries, q.new_zeros(heads, 2, dim)], 1)[None]
    k, v, key_mask, key_bias = (_only_row(t) for t in (k, v, key_mask, key_bias))
    mask = key_bias
    if mask is None and key_mask is not None:
        mask = key_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, scale=scale)
    out = out[0, :, :rows].reshape(heads, num_candidates, query_len, dim).permute(1, 0, 2, 3)
    # Contiguous strides, size-1 dims included: a cond's branches must agree on them.
    return out.clone(memory_format=torch.contiguous_format)


def per_request_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    candidate_to_request: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``rocs::broadcast_attention`` (same arguments and value) with each request's keys and
    values read per request, in ops that export with dynamic R and N (module docstring)."""
    one_request = k.shape[0] == 1
    if not torch.compiler.is_compiling():
        if one_request:
            return _one_request_attention(q, k, v, key_mask, scale, key_bias)
        return _in_tiles(q, k, v, candidate_to_request, key_mask, scale, key_bias)
    # A cond's operands must not share storage, and keys and values often do (views of one
    # packed projection, ``nn.MultiheadAttention``'s K/V): the request-side operands (R rows)
    # are copied, which costs R rows, never N. The tiles' own cond on spills needs the copies
    # too, where a trace fixed R (a number: no cond on R == 1 to keep).
    has_mask, has_bias = key_mask is not None, key_bias is not None
    masks = [t.clone() for t in (key_mask, key_bias) if t is not None]
    k, v = k.clone(), v.clone()

    def unpack(masks):
        given = iter(masks)
        return (next(given) if has_mask else None), (next(given) if has_bias else None)

    if isinstance(one_request, bool):
        mask, bias = unpack(masks)
        if one_request:
            return _one_request_attention(q, k, v, mask, scale, bias)
        return _in_tiles(q, k, v, candidate_to_request, mask, scale, bias)

    def one_request_branch(q, k, v, candidate_to_request, *masks):
        mask, bias = unpack(masks)
        return _one_request_attention(q, k, v, mask, scale, bias)

    def in_tiles(q, k, v, candidate_to_request, *masks):
        mask, bias = unpack(masks)
        return _in_tiles(q, k, v, candidate_to_request, mask, scale, bias)

    operands = (q, k, v, candidate_to_request, *masks)
    return torch.cond(one_request, one_request_branch, in_tiles, operands)


def _in_tiles(q, k, v, candidate_to_request, key_mask, scale, key_bias) -> torch.Tensor:
    """:func:`per_request_attention` for any number of requests, in tiles (module docstring)."""
    num_candidates, num_requests = q.shape[0], k.shape[0]
    rank, counts = candidate_ranks(candidate_to_request, num_requests)
    spills = (counts > tile_rows_for(num_candidates, num_requests)).any()
    has_mask, has_bias = key_mask is not None, key_bias is not None

    def branch(spill: bool):
        def run(q, k, v, candidate_to_request, rank, counts, *masks):
            given = iter(masks)
            mask = next(given) if has_mask else None
            bias = next(given) if has_bias else None
            return _attend_in_tiles(
                q, k, v, candidate_to_request, mask, scale, bias, rank, counts, spill
            )

        return run

    masks = [t for t in (key_mask, key_bias) if t is not None]
    operands = (q, k, v, candidate_to_request, rank, counts, *masks)
    if not torch.compiler.is_compiling():
        return branch(bool(spills))(*operands)
    return torch.cond(spills, branch(True), branch(False), operands)
