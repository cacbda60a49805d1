"""The prefill chunk planner: which requests and which of their queries share one logits piece.

``split_prefill_chunks`` has the semantics of vLLM's ``split_indexer_prefill_chunks``
(vllm-project/vllm, ``vllm/v1/attention/backends/mla/indexer.py``, read at commit
0023368d052caf392d159ab32d380a807a89be99). For every valid input it returns the same list of
slices. (Older revisions of that file stepped a kv-less group by ``chunk_m``, which raises for a
group of only empty requests; the revision matched here, and this module, use ``max(1, chunk_m)``.)

Deliberate differences, none of which changes a result:
- the lengths may be any sequence of ints (list, tuple, numpy array, CPU tensor), not only CPU
  tensors; vLLM calls ``.item()`` per element;
- negative lengths, mismatched lengths, a negative budget and a non-int offset raise
  ``ValueError`` (vLLM does not check);
- ``split_rows`` and ``chunk_footprints`` are additions used by the driver and the tests.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["split_prefill_chunks", "split_rows", "chunk_footprints", "LOGITS_ELEM_BYTES"]

LOGITS_ELEM_BYTES = 4
"""The logits are float32; the planner budgets ``M * N * 4`` bytes per piece."""


def _ints(values, name: str) -> list[int]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    out = [int(v) for v in values]
    for i, v in enumerate(out):
        if v < 0:
            raise ValueError(f"{name}[{i}] is {v}; lengths must be >= 0")
    return out


def split_prefill_chunks(seq_lens: Sequence[int], query_lens: Sequence[int], workspace_size: int,
                         max_logits_bytes: int, request_offset: int = 0
                         ) -> list[tuple[slice, slice]]:
    """Plan a prefill batch into pieces of bounded logits size.

    ``seq_lens[r]`` is request r's kv length (the logits width it contributes; compressed kv
    entries when a compress ratio applies) and ``query_lens[r]`` its query count (rows).
    Requests are packed greedily, in order, while the summed kv length stays within
    ``workspace_size`` and ``summed_queries * summed_kv * 4 <= max_logits_bytes``. A request
    that does not fit even alone is taken alone and, if its logits exceed the budget, split
    along its queries only into pieces of ``max(1, (max_logits_bytes // 4) // kv_len)`` rows
    (its kv is never sliced, so a kv view keeps its alignment).

    Returns ``(request_slice, query_slice)`` pairs: ``request_slice`` indexes requests (shifted
    by ``request_offset``) and ``query_slice`` indexes the concatenated queries of those
    requests, starting at 0 for each group. A group without queries produces no pair, so empty
    requests produce none.

    The budgets hold for every pair except in two documented cases: a single request whose kv
    alone exceeds ``workspace_size`` forms its own group, and a single query row whose kv alone
    exceeds the logits budget forms its own piece (``M == 1``).
    """
    seqs = _ints(seq_lens, "seq_lens")
    queries = _ints(query_lens, "query_lens")
    if len(seqs) != len(queries):
        raise ValueError(f"seq_lens has {len(seqs)} entries but query_lens has {len(queries)}")
    if workspace_size < 0 or max_logits_bytes < 0:
        raise ValueError("workspace_size and max_logits_bytes must be >= 0")
    if not isinstance(request_offset, int):
        raise ValueError(f"request_offset must be an int, got {request_offset!r}")
    max_elems = max_logits_bytes // LOGITS_ELEM_BYTES
    plan: list[tuple[slice, slice]] = []
    n = len(seqs)
    end = 0
    while end < n:
        start, rows, width = end, 0, 0
        while end < n:
            grown_rows, grown_width = rows + queries[end], width + seqs[end]
            if grown_width > workspace_size or grown_rows * grown_width > max_elems:
                break
            rows, width = grown_rows, grown_width
            end += 1
        if end == start:
            # Too big even alone: it gets its own group, split along its queries below.
            rows, width = queries[end], seqs[end]
            end += 1
        requests = slice(start + request_offset, end + request_offset)
        step = max(1, max_elems // width) if width > 0 else max(1, rows)
        for q0 in range(0, rows, step):
            plan.append((requests, slice(q0, min(rows, q0 + step))))
    return plan


def split_rows(rows: slice, width: int, max_bytes: int, elem_bytes: int = LOGITS_ELEM_BYTES
               ) -> list[slice]:
    """Split a row range so that ``len(piece) * width * elem_bytes <= max_bytes`` for every
    piece, one row being the least a piece can hold. The driver uses it after padding a
    piece's width for alignment, which can push a planned piece just over the budget."""
    start, stop = rows.start, rows.stop
    if stop <= start:
        return []
    step = max(1, max_bytes // max(1, width * elem_bytes))
    return [slice(r, min(stop, r + step)) for r in range(start, stop, step)]


def chunk_footprints(plan: list[tuple[slice, slice]], seq_lens: Sequence[int],
                     request_offset: int = 0) -> list[tuple[int, int]]:
    """``(rows, width)`` of every piece of a plan: its logits are ``rows x width`` floats."""
    seqs = _ints(seq_lens, "seq_lens")
    out = []
    for requests, queries in plan:
        width = sum(seqs[requests.start - request_offset:requests.stop - request_offset])
        out.append((queries.stop - queries.start, width))
    return out
