"""The indexer's prefill path: plan, logits pieces from the workspace arena, top-k.

A prefill batch is R requests; request r brings ``query_lens[r]`` new tokens (rows of q and w,
requests concatenated in order) and has ``seq_lens[r]`` tokens in all once they are added, so
its new tokens sit at positions ``seq_lens[r] - query_lens[r] ..< seq_lens[r]``. Its kv holds
``seq_lens[r] // compress_ratio`` entries and the token at position p sees the first
``(p + 1) // compress_ratio`` of them. The result row of a token lists, relative to its
request's first kv entry, the ``k`` entries with the largest logits (``-1`` pads).

The logits of a piece are a ``rows x width`` float32 buffer. Its size follows the plan
(``split_prefill_chunks``, vLLM's semantics), so every buffer fits ``max_logits_bytes``
(one-row pieces excepted, as the planner documents) and each is allocated inside
``alloc.workspace()`` — the arena when the allocator is installed — and released before the
next one is taken. Nothing else is allocated inside that scope.
"""

from __future__ import annotations

import contextlib
import os
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .logits import LogitsConfig, mqa_logits, paged_mqa_logits, row_stride_elems
from .planner import split_prefill_chunks, split_rows
from .topk import TopkConfig
from .topk import default_config as topk_default_config
from .topk import scratch_elems
from .topk import top_k_per_row

__all__ = ["PagedKV", "PrefillStats", "prefill_topk", "token_ranges"]

DEFAULT_MAX_LOGITS_BYTES = 512 << 20


@dataclass(frozen=True)
class PagedKV:
    """A paged indexer kv cache: ``cache`` ``[num_blocks, PAGE, D]``, ``scale`` float32
    ``[num_blocks, PAGE]`` and ``block_table`` int32 ``[R, max_blocks]`` (request r's kv entry
    p is in page ``block_table[r, p // PAGE]``, slot ``p % PAGE``)."""
    cache: torch.Tensor
    scale: torch.Tensor
    block_table: torch.Tensor


@dataclass
class PrefillStats:
    """What a ``prefill_topk`` call did; pass one in to have it filled. Times are device times
    (CUDA events) on a GPU and host times on the CPU; filling them synchronizes once at the end.
    """
    pieces: int = 0
    max_piece_bytes: int = 0
    logits_s: float = 0.0
    topk_s: float = 0.0
    piece_shapes: list[tuple[int, int]] = field(default_factory=list)
    calls: list | None = None
    """Set to a list to have each piece recorded as ``(rows, row_stride, width, logits,
    select)``: ``logits(out=view)`` and ``select(view)`` rerun the piece's two kernels on any
    ``[rows, width]`` view, so a benchmark can time the kernels alone, back to back."""
    _marks: list = field(default_factory=list, repr=False)


def _arena_scope() -> Callable[[], contextlib.AbstractContextManager]:
    # Imported here, not at the top: the kernels, the planner and the tests that pass their own
    # scope need no built alloc extension.
    from alloc import workspace
    return workspace


def _int_list(values, name: str) -> list[int]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    out = [int(v) for v in values]
    if any(v < 0 for v in out):
        raise ValueError(f"{name} must be >= 0")
    return out


def _prefix(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def token_ranges(query_lens: Sequence[int], seq_lens: Sequence[int], compress_ratio: int,
                 group_of_request: Sequence[int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU int32 ``(ks, ke)`` per token: the kv columns a token sees, counted from the first kv
    entry of ``group_of_request[r]`` (the first request of its piece; by default each request
    starts its own count, as in the returned indices)."""
    ql = np.array(_int_list(query_lens, "query_lens"), dtype=np.int64)
    sl = np.array(_int_list(seq_lens, "seq_lens"), dtype=np.int64)
    ks = np.empty(int(ql.sum()), dtype=np.int32)
    ke = np.empty_like(ks)
    _fill_token_ranges(ks, ke, ql, sl, compress_ratio, group_of_request)
    return torch.from_numpy(ks), torch.from_numpy(ke)


def _fill_token_ranges(ks: np.ndarray, ke: np.ndarray, ql: np.ndarray, sl: np.ndarray,
                       compress_ratio: int, group_of_request: Sequence[int] | None) -> None:
    # numpy, not torch: at a few thousand tokens torch's per-op CPU overhead dominates
    # (~100 us a call against ~20 us).
    base = np.zeros_like(ql)
    if group_of_request is not None:
        firsts = np.asarray(group_of_request, dtype=np.int64)
        if firsts.shape != ql.shape:
            raise ValueError("group_of_request needs one entry per request")
        kvl = sl // compress_ratio
        kv_start = np.cumsum(kvl) - kvl
        base = kv_start - kv_start[firsts]
    # Token i of request r (i counted over the batch) sits at position
    # sl[r] - ql[r] + (i - first token of r), and sees (position + 1) // ratio kv entries.
    first_token = np.cumsum(ql) - ql
    seen = np.arange(1, ks.size + 1) + np.repeat(sl - ql - first_token, ql)
    base_of_token = np.repeat(base, ql)
    ks[:] = base_of_token
    ke[:] = base_of_token + seen // compress_ratio


def prefill_topk(q: torch.Tensor, w: torch.Tensor, query_lens: Sequence[int],
                 seq_lens: Sequence[int], *, kv: torch.Tensor | None = None,
                 kv_scale: torch.Tensor | None = None, paged: PagedKV | None = None,
                 k: int = 2048, max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES,
                 compress_ratio: int = 1, workspace_size: int | None = None,
                 out: torch.Tensor | None = None,
                 workspace: Callable[[], contextlib.AbstractContextManager] | None = None,
                 stats: PrefillStats | None = None, logits_config: LogitsConfig | None = None,
                 topk_config: TopkConfig | None = None) -> torch.Tensor:
    """Top-k kv indices of every new token of a prefill batch, with bounded logits memory.

    Shapes: q ``[T, H, D]`` (bf16, fp8 e4m3 or float32) and w ``[T, H]`` float32, with
    ``T = sum(query_lens)``;
    ``query_lens`` and ``seq_lens`` are host-side int sequences of length R (``seq_lens[r]``
    uncompressed, ``>= query_lens[r]``). The kv is either dense — ``kv`` ``[sum_r
    seq_lens[r] // compress_ratio, D]`` with ``kv_scale`` float32 of the same length, requests
    concatenated — or ``paged`` (see PagedKV). ``workspace_size`` bounds the summed kv length of
    the requests planned together (default: no bound). ``workspace`` replaces
    ``alloc.workspace`` as the scope every logits buffer is allocated in.

    Returns ``out`` (int32 ``[T, k]``, allocated if not given): per token, kv entries relative
    to its request's first, ``-1`` padded.
    """
    if (kv is None) == (paged is None):
        raise ValueError("give exactly one of kv (dense) or paged")
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("q is on the CPU, where the kernels run only under Triton's interpreter: set "
                         "TRITON_INTERPRET=1 before the first import of triton (slow; for tests), or move "
                         "the tensors to a CUDA device")
    if compress_ratio < 1:
        raise ValueError(f"compress_ratio must be >= 1, got {compress_ratio}")
    if max_logits_bytes < 4:
        raise ValueError("max_logits_bytes must allow at least one float")
    ql = _int_list(query_lens, "query_lens")
    sl = _int_list(seq_lens, "seq_lens")
    if len(ql) != len(sl):
        raise ValueError("query_lens and seq_lens must have the same length")
    if any(q > s for q, s in zip(ql, sl)):
        raise ValueError("each query_lens[r] must be <= seq_lens[r]")
    kvl = [s // compress_ratio for s in sl]
    cu_q, cu_kv = _prefix(ql), _prefix(kvl)
    t_all = cu_q[-1]
    if q.dim() != 3 or q.shape[0] != t_all or w.shape != (t_all, q.shape[1]):
        raise ValueError(f"q must be [{t_all}, H, D] and w [{t_all}, H]; got "
                         f"{tuple(q.shape)} and {tuple(w.shape)}")
    if kv is not None:
        if kv.shape[0] != cu_kv[-1] or kv_scale is None or kv_scale.shape != (cu_kv[-1],):
            raise ValueError(f"dense kv must have {cu_kv[-1]} rows and kv_scale as many entries")
    elif paged.block_table.shape[0] != len(ql):
        raise ValueError("the block table needs one row per request")
    device = q.device
    if out is None:
        out = torch.empty((t_all, k), dtype=torch.int32, device=device)
    elif out.shape != (t_all, k) or out.dtype != torch.int32:
        raise ValueError(f"out must be int32 [{t_all}, {k}]")
    if t_all == 0:
        return out

    plan = split_prefill_chunks(kvl, ql, workspace_size if workspace_size is not None
                                else cu_kv[-1], max_logits_bytes)
    group_of = list(range(len(ql)))
    group_stop = {}
    for requests, _ in plan:
        group_stop[requests.start] = requests.stop
        for r in range(requests.start, requests.stop):
            group_of[r] = requests.start
    # One host-to-device copy per call: ks, ke and, paged, each group's kv starts, written
    # straight into the buffer that is copied.
    cu_at = {}
    n_meta = 2 * t_all
    if paged is not None:
        for start, stop in group_stop.items():
            cu_at[start] = n_meta
            n_meta += stop - start + 1
    cuda = device.type == "cuda"
    # From pageable memory the copy would wait for the stream to drain, so every call
    # would leave the GPU idle while this host code plans the next one.
    meta_host = torch.empty(n_meta, dtype=torch.int32, pin_memory=cuda)
    meta = meta_host.numpy()
    _fill_token_ranges(meta[:t_all], meta[t_all:2 * t_all], np.array(ql, dtype=np.int64),
                       np.array(sl, dtype=np.int64), compress_ratio, group_of)
    for start, at in cu_at.items():
        stop = group_stop[start]
        meta[at:at + stop - start + 1] = np.array(cu_kv[start:stop + 1]) - cu_kv[start]
    meta_dev = meta_host.to(device, non_blocking=True) if cuda else meta_host
    ks_dev, ke_dev = meta_dev[:t_all], meta_dev[t_all:2 * t_all]

    scope = workspace or _arena_scope()
    tcfg = topk_config or topk_default_config(k, device.type)
    scratch = torch.empty(scratch_elems(2**31 - 1, device, tcfg), dtype=torch.int32,
                          device=device)
    timed = stats is not None

    def mark():
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    for requests, queries in plan:
        c0 = cu_kv[requests.start]
        width = cu_kv[requests.stop] - c0
        base = cu_q[requests.start]
        rows = slice(base + queries.start, base + queries.stop)
        if width == 0:
            out[rows].fill_(-1)
            continue
        stride = row_stride_elems(width)
        for piece in split_rows(rows, stride, max_logits_bytes):
            m = piece.stop - piece.start
            with scope():
                buf = torch.empty((m, stride), dtype=torch.float32, device=device)
            view = buf[:, :width]
            if timed:
                stats.pieces += 1
                stats.max_piece_bytes = max(stats.max_piece_bytes, buf.numel() * 4)
                stats.piece_shapes.append((m, width))
                t0 = mark()
            qp, wp, ksp, kep = q[piece], w[piece], ks_dev[piece], ke_dev[piece]
            # clean=False: the top-k reads only [ks, ke), so tiles outside it stay unwritten.
            if paged is None:
                logits = functools.partial(mqa_logits, qp, kv[c0:c0 + width],
                                           kv_scale[c0:c0 + width], wp, ksp, kep, clean=False,
                                           config=logits_config)
            else:
                at = cu_at[requests.start]
                logits = functools.partial(
                    paged_mqa_logits, qp, paged.cache, paged.scale, wp, ksp, kep,
                    paged.block_table[requests],
                    cu_kv=meta_dev[at:at + requests.stop - requests.start + 1], clean=False,
                    config=logits_config)
            select = functools.partial(top_k_per_row, ks=ksp, ke=kep, k=k, out=out[piece],
                                       scratch=scratch, config=tcfg)
            logits(out=view)
            if timed:
                t1 = mark()
            select(view)
            if timed:
                stats._marks.append((t0, t1, mark()))
                if stats.calls is not None:
                    stats.calls.append((m, stride, width, logits, select))
            # Give the block back before the next piece asks for one: at most one logits
            # buffer is alive at a time.
            del view, buf
    if timed:
        if cuda:
            torch.cuda.synchronize(device)
            for a, b, c in stats._marks:
                stats.logits_s += a.elapsed_time(b) / 1e3
                stats.topk_s += b.elapsed_time(c) / 1e3
        else:
            for a, b, c in stats._marks:
                stats.logits_s += b - a
                stats.topk_s += c - b
        stats._marks.clear()
    return out
