"""The indexer's prefill path: plan, logits pieces from the workspace arena, top-k.

A prefill batch is R requests; request r brings ``query_lens[r]`` new tokens (rows of q and w,
requests concatenated in order) and has ``seq_lens[r]`` tokens in all once they are added, so
its new tokens sit at positions ``seq_lens[r] - query_lens[r] ..< seq_lens[r]``. Its kv holds
``seq_lens[r] // compress_ratio`` entries and the token at position p sees the first
``(p + 1) // compress_ratio`` of them. The result row of a token lists, relative to its
request's first kv entry, the ``k`` entries with the largest logits (``-1`` pads).

The kv is a ``DenseKV`` (the requests' entries concatenated) or a ``PagedKV`` (a paged cache
and its block table). The logits of a piece are a ``rows x width`` float32 buffer. Its size
follows the plan (``split_prefill_chunks``, vLLM's semantics), so every buffer fits
``max_logits_bytes`` (one-row pieces excepted, as the planner documents) and each is allocated
inside ``alloc.workspace()`` — the arena when the allocator is installed — and released before
the next one is taken. Nothing else is allocated inside that scope.

``prefill_topk`` reads as its steps: ``_check_arguments``, ``_plan`` (the planner's pieces and
the groups of requests planned together), ``_pack_metadata`` (ks, ke and the groups' kv starts
in one host-to-device copy), ``_topk_scratch``, then ``_run_piece`` per piece.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ._device import capability
from .logits import (LogitsConfig, mqa_logits, paged_mqa_logits, row_stride_elems,
                     supported_dtypes)
from .planner import LOGITS_ELEM_BYTES, split_prefill_chunks, split_rows
from .topk import TopkConfig
from .topk import default_config as topk_default_config
from .topk import scratch_elems, top_k_per_row

__all__ = ["DenseKV", "PagedKV", "PrefillPiece", "PrefillStats", "prefill_topk", "token_ranges"]

DEFAULT_MAX_LOGITS_BYTES = 512 << 20


# --------------------------------------------------------------------------------------------
# the kv: dense or paged
# --------------------------------------------------------------------------------------------

def _check_tensors(owner: str, *named: tuple[str, torch.Tensor]) -> None:
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{owner}.{name} must be a torch.Tensor, got {type(t).__name__}")
    device = named[0][1].device
    if any(t.device != device for _, t in named):
        where = ", ".join(f"{name} on {t.device}" for name, t in named)
        raise ValueError(f"{owner}'s tensors must be on one device; got {where}")


def _check_values(owner: str, name: str, t: torch.Tensor, dims: int, shape: str) -> None:
    if t.dim() != dims or t.stride(-1) != 1:
        raise ValueError(f"{owner}.{name} must be {shape} with contiguous rows, got shape "
                         f"{tuple(t.shape)} strides {t.stride()}")
    if t.dtype not in supported_dtypes():
        names = ", ".join(str(d) for d in supported_dtypes())
        raise ValueError(f"{owner}.{name} has dtype {t.dtype}; supported: {names}")


def _check_scale(owner: str, scale: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if scale.dtype != torch.float32 or scale.shape != shape:
        raise ValueError(f"{owner}.scale must be float32 {list(shape)} ({what}), got "
                         f"{scale.dtype} {list(scale.shape)}")


@dataclass(frozen=True, eq=False)
class DenseKV:
    """A dense indexer kv: ``kv`` ``[N, D]`` (bf16, fp16, fp8 e4m3 or float32; rows contiguous)
    and ``scale`` float32 ``[N]``, the requests' entries concatenated in order."""
    kv: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self):
        _check_tensors("DenseKV", ("kv", self.kv), ("scale", self.scale))
        _check_values("DenseKV", "kv", self.kv, 2, "[N, D]")
        _check_scale("DenseKV", self.scale, (self.kv.shape[0],), "one per kv row")

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def _check_batch(self, kv_lens: list[int]) -> None:
        if self.kv.shape[0] != sum(kv_lens):
            raise ValueError(f"DenseKV has {self.kv.shape[0]} rows; the batch needs "
                             f"{sum(kv_lens)} (the sum of seq_lens[r] // compress_ratio)")

    def _logits(self, piece: PrefillPiece, q, w, ks, ke, meta: _Metadata, config):
        # clean=False: the top-k reads only [ks, ke), so tiles outside it stay unwritten.
        return functools.partial(mqa_logits, q, self.kv[piece.cols], self.scale[piece.cols], w,
                                 ks, ke, clean=False, config=config)


@dataclass(frozen=True, eq=False)
class PagedKV:
    """A paged indexer kv cache: ``cache`` ``[num_blocks, PAGE, D]`` (rows contiguous, other
    strides free), ``scale`` float32 ``[num_blocks, PAGE]`` and ``block_table`` int32
    ``[R, max_blocks]`` (request r's kv entry p is in page ``block_table[r, p // PAGE]``, slot
    ``p % PAGE``)."""
    cache: torch.Tensor
    scale: torch.Tensor
    block_table: torch.Tensor

    def __post_init__(self):
        _check_tensors("PagedKV", ("cache", self.cache), ("scale", self.scale),
                       ("block_table", self.block_table))
        _check_values("PagedKV", "cache", self.cache, 3, "[num_blocks, PAGE, D]")
        _check_scale("PagedKV", self.scale, tuple(self.cache.shape[:2]), "one per cache row")
        bt = self.block_table
        if bt.dim() != 2 or bt.dtype != torch.int32 or bt.stride(1) != 1:
            raise ValueError(f"PagedKV.block_table must be int32 [R, max_blocks] with contiguous "
                             f"rows, got {bt.dtype} {list(bt.shape)}")

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def _check_batch(self, kv_lens: list[int]) -> None:
        rows, blocks = self.block_table.shape
        if rows != len(kv_lens):
            raise ValueError(f"PagedKV.block_table has {rows} rows; the batch has "
                             f"{len(kv_lens)} requests (one row each)")
        page, longest = self.cache.shape[1], max(kv_lens, default=0)
        if blocks * page < longest:
            raise ValueError(f"PagedKV.block_table holds {blocks} pages of {page} a request; a "
                             f"request of the batch has {longest} kv entries")

    def _logits(self, piece: PrefillPiece, q, w, ks, ke, meta: _Metadata, config):
        # clean=False: the top-k reads only [ks, ke), so tiles outside it stay unwritten.
        return functools.partial(paged_mqa_logits, q, self.cache, self.scale, w, ks, ke,
                                 self.block_table[piece.requests],
                                 cu_kv=meta.group_cu_kv[piece.requests.start], clean=False,
                                 config=config)


# --------------------------------------------------------------------------------------------
# what a call reports: pieces, statistics, timing
# --------------------------------------------------------------------------------------------

class PrefillPiece(NamedTuple):
    """One logits piece of a prefill call: the token ``rows`` of the batch it scores (rows of
    q, w and the result), the ``requests`` planned together with it and their kv ``cols``
    (columns of the requests' concatenated kv, as a ``DenseKV`` holds them). Its logits buffer
    is float32 ``[num_rows, stride]``, of which ``[:, :width]`` is used."""
    rows: slice
    requests: slice
    cols: slice
    stride: int

    @property
    def num_rows(self) -> int:
        return self.rows.stop - self.rows.start

    @property
    def width(self) -> int:
        return self.cols.stop - self.cols.start

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.stride * LOGITS_ELEM_BYTES


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


class _Timer:
    """Fills a PrefillStats: per piece its shape and three clock marks (before the logits,
    between the kernels, after the top-k), summed into the stats once at the end."""

    def __init__(self, stats: PrefillStats, device: torch.device):
        self.stats, self.device, self.cuda = stats, device, device.type == "cuda"
        self.marks: list[tuple] = []
        self._started = self._logits_done = None

    def _clock(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self, piece: PrefillPiece) -> None:
        self.stats.pieces += 1
        self.stats.max_piece_bytes = max(self.stats.max_piece_bytes, piece.nbytes)
        self.stats.piece_shapes.append((piece.num_rows, piece.width))
        self._started = self._clock()

    def logits_done(self) -> None:
        self._logits_done = self._clock()

    def topk_done(self) -> None:
        self.marks.append((self._started, self._logits_done, self._clock()))

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for started, logits_done, topk_done in self.marks:
            self.stats.logits_s += self._seconds(started, logits_done)
            self.stats.topk_s += self._seconds(logits_done, topk_done)
        self.marks.clear()

    def _seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


class _Untimed:
    """The timer of a call without stats: every mark does nothing."""

    def start(self, piece: PrefillPiece) -> None:
        pass

    def logits_done(self) -> None:
        pass

    def topk_done(self) -> None:
        pass

    def finish(self) -> None:
        pass


_UNTIMED = _Untimed()

PieceCallback = Callable[[PrefillPiece, Callable[..., torch.Tensor], Callable[..., torch.Tensor]],
                         None]


# --------------------------------------------------------------------------------------------
# token ranges
# --------------------------------------------------------------------------------------------

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
    # numpy, not torch: at a few thousand tokens torch's per-op CPU overhead dominates.
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


# --------------------------------------------------------------------------------------------
# the steps of a call
# --------------------------------------------------------------------------------------------

class _Batch(NamedTuple):
    """The checked lengths of a batch: per request its new tokens, its tokens in all and its
    kv entries, and prefix sums of its tokens (``cu_q``) and kv entries (``cu_kv``), both
    ``[R + 1]``."""
    query_lens: list[int]
    seq_lens: list[int]
    kv_lens: list[int]
    cu_q: list[int]
    cu_kv: list[int]
    compress_ratio: int

    @property
    def tokens(self) -> int:
        return self.cu_q[-1]


def _check_arguments(q: torch.Tensor, w: torch.Tensor, query_lens, seq_lens, kv, *, k: int,
                     compress_ratio: int, max_logits_bytes: int,
                     out: torch.Tensor | None) -> _Batch:
    if not isinstance(kv, (DenseKV, PagedKV)):
        raise TypeError(f"kv must be DenseKV(kv, scale) or PagedKV(cache, scale, block_table), "
                        f"got {type(kv).__name__}")
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("q is on the CPU, where the kernels run only under Triton's interpreter: set "
                         "TRITON_INTERPRET=1 before the first import of triton (slow; for tests), or move "
                         "the tensors to a CUDA device")
    if compress_ratio < 1:
        raise ValueError(f"compress_ratio must be >= 1, got {compress_ratio}")
    if max_logits_bytes < 4:
        raise ValueError("max_logits_bytes must allow at least one float")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    ql = _int_list(query_lens, "query_lens")
    sl = _int_list(seq_lens, "seq_lens")
    if len(ql) != len(sl):
        raise ValueError("query_lens and seq_lens must have the same length")
    if any(q > s for q, s in zip(ql, sl)):
        raise ValueError("each query_lens[r] must be <= seq_lens[r]")
    kvl = [s // compress_ratio for s in sl]
    batch = _Batch(ql, sl, kvl, _prefix(ql), _prefix(kvl), compress_ratio)
    t = batch.tokens
    if q.dim() != 3 or q.shape[0] != t or w.shape != (t, q.shape[1]):
        raise ValueError(f"q must be [{t}, H, D] and w [{t}, H]; got "
                         f"{tuple(q.shape)} and {tuple(w.shape)}")
    if kv.device != q.device:
        raise ValueError(f"kv is on {kv.device} but q on {q.device}")
    kv._check_batch(batch.kv_lens)
    if out is not None and (out.shape != (t, k) or out.dtype != torch.int32
                            or out.device != q.device):
        raise ValueError(f"out must be int32 [{t}, {k}] on {q.device}, got {out.dtype} "
                         f"{list(out.shape)} on {out.device}")
    return batch


class _Plan(NamedTuple):
    """The pieces of a call, in order; the token rows of groups without kv (their result is
    all ``-1``); the groups of requests planned together and, per request, its group's first
    request."""
    pieces: list[PrefillPiece]
    empty_rows: list[slice]
    groups: list[slice]
    first_of_request: list[int]

    @property
    def tallest_piece(self) -> int:
        """The most rows a piece has: what the top-k scratch is sized for."""
        return max((p.num_rows for p in self.pieces), default=1)


def _plan(batch: _Batch, *, workspace_size: int | None, max_logits_bytes: int) -> _Plan:
    chunks = split_prefill_chunks(batch.kv_lens, batch.query_lens,
                                  batch.cu_kv[-1] if workspace_size is None else workspace_size,
                                  max_logits_bytes)
    # A request split along its queries appears in several chunks: one group.
    bounds = list(dict.fromkeys((requests.start, requests.stop) for requests, _ in chunks))
    first_of_request = list(range(len(batch.query_lens)))
    for start, stop in bounds:
        first_of_request[start:stop] = [start] * (stop - start)
    pieces, empty_rows = [], []
    for requests, queries in chunks:
        cols = slice(batch.cu_kv[requests.start], batch.cu_kv[requests.stop])
        base = batch.cu_q[requests.start]
        rows = slice(base + queries.start, base + queries.stop)
        if cols.stop == cols.start:
            empty_rows.append(rows)
            continue
        # The padded row stride can push a planned piece just over the budget: split again.
        stride = row_stride_elems(cols.stop - cols.start)
        pieces += [PrefillPiece(part, requests, cols, stride)
                   for part in split_rows(rows, stride, max_logits_bytes)]
    return _Plan(pieces, empty_rows, [slice(a, b) for a, b in bounds], first_of_request)


class _Metadata(NamedTuple):
    """The call's int32 metadata on the device: per token the kv columns it sees (``ks``,
    ``ke``, counted from its group's first kv entry) and, for a paged kv, each group's kv
    starts (``[n + 1]`` relative to the group's first entry), keyed by its first request."""
    ks: torch.Tensor
    ke: torch.Tensor
    group_cu_kv: dict[int, torch.Tensor]


def _pack_metadata(batch: _Batch, plan: _Plan, *, group_offsets: bool,
                   device: torch.device) -> _Metadata:
    # One host-to-device copy per call, of a buffer laid out as
    # [ks (T) | ke (T) | group 0's kv starts | group 1's | ...], written in place.
    t = batch.tokens
    groups = plan.groups if group_offsets else []
    spans, end = [], 2 * t
    for g in groups:
        spans.append(slice(end, end + g.stop - g.start + 1))
        end = spans[-1].stop
    cuda = device.type == "cuda"
    # From pageable memory the copy would wait for the stream to drain, so every call
    # would leave the GPU idle while this host code plans the next one.
    host = torch.empty(end, dtype=torch.int32, pin_memory=cuda)
    packed = host.numpy()
    _fill_token_ranges(packed[:t], packed[t:2 * t], np.array(batch.query_lens, dtype=np.int64),
                       np.array(batch.seq_lens, dtype=np.int64), batch.compress_ratio,
                       plan.first_of_request)
    for g, span in zip(groups, spans):
        packed[span] = np.array(batch.cu_kv[g.start:g.stop + 1]) - batch.cu_kv[g.start]
    dev = host.to(device, non_blocking=True) if cuda else host
    return _Metadata(ks=dev[:t], ke=dev[t:2 * t],
                     group_cu_kv={g.start: dev[span] for g, span in zip(groups, spans)})


def _topk_scratch(plan: _Plan, *, device: torch.device, config: TopkConfig) -> torch.Tensor:
    # One scratch for every piece's top-k: its size depends on the rows, not the width.
    return torch.empty(scratch_elems(plan.tallest_piece, device, config), dtype=torch.int32,
                       device=device)


def _run_piece(piece: PrefillPiece, *, q: torch.Tensor, w: torch.Tensor, kv, meta: _Metadata,
               out: torch.Tensor, k: int, scratch: torch.Tensor, scope, timer,
               on_piece: PieceCallback | None, logits_config: LogitsConfig | None,
               topk_config: TopkConfig) -> None:
    with scope():
        buf = torch.empty((piece.num_rows, piece.stride), dtype=torch.float32, device=q.device)
    view = buf[:, :piece.width]
    timer.start(piece)
    rows = piece.rows
    ks, ke = meta.ks[rows], meta.ke[rows]
    logits = kv._logits(piece, q[rows], w[rows], ks, ke, meta, logits_config)
    select = functools.partial(top_k_per_row, ks=ks, ke=ke, k=k, out=out[rows],
                               scratch=scratch, config=topk_config)
    logits(out=view)
    timer.logits_done()
    select(view)
    timer.topk_done()
    if on_piece is not None:
        on_piece(piece, logits, select)
    # Give the block back before the next piece asks for one: at most one logits buffer is
    # alive at a time.
    del view, buf


def _arena_scope() -> Callable[[], contextlib.AbstractContextManager]:
    # Imported here, not at the top: the kernels, the planner and the tests that pass their own
    # scope need no built alloc extension.
    from alloc import workspace
    return workspace


def _removed_keywords(removed: dict) -> TypeError:
    if {"kv_scale", "paged"} & removed.keys():
        return TypeError("prefill_topk takes the kv as one argument: kv=DenseKV(kv, kv_scale) "
                         "or kv=PagedKV(cache, scale, block_table); kv_scale= and paged= are gone")
    return TypeError(f"prefill_topk() got an unexpected keyword argument {sorted(removed)[0]!r}")


# --------------------------------------------------------------------------------------------
# the public function
# --------------------------------------------------------------------------------------------

def prefill_topk(q: torch.Tensor, w: torch.Tensor, query_lens: Sequence[int],
                 seq_lens: Sequence[int], kv: DenseKV | PagedKV, *, k: int = 2048,
                 compress_ratio: int = 1, max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES,
                 workspace_size: int | None = None, out: torch.Tensor | None = None,
                 workspace: Callable[[], contextlib.AbstractContextManager] | None = None,
                 stats: PrefillStats | None = None, on_piece: PieceCallback | None = None,
                 logits_config: LogitsConfig | None = None,
                 topk_config: TopkConfig | None = None, **removed) -> torch.Tensor:
    """Top-k kv indices of every new token of a prefill batch, with bounded logits memory.

    Shapes: q ``[T, H, D]`` (bf16, fp8 e4m3 or float32) and w ``[T, H]`` float32, with
    ``T = sum(query_lens)``; ``query_lens`` and ``seq_lens`` are host-side int sequences of
    length R (``seq_lens[r]`` uncompressed, ``>= query_lens[r]``). ``kv`` is a ``DenseKV``
    with ``sum_r seq_lens[r] // compress_ratio`` rows, requests concatenated, or a ``PagedKV``
    with one block-table row per request; on q's device, in q's dtype.

    ``max_logits_bytes`` bounds each piece's float32 logits buffer; ``workspace_size`` bounds
    the summed kv length of the requests planned together (default: no bound). ``workspace``
    replaces ``alloc.workspace`` as the scope every logits buffer is allocated in. ``stats``,
    if given, is filled with the pieces and the kernels' times (one synchronization at the
    end). ``on_piece(piece, logits, select)``, if given, is called once per piece (a
    ``PrefillPiece``) after its kernels are launched; ``logits(out=view)`` and ``select(view)``
    rerun them on any float32 ``[piece.num_rows, piece.width]`` view with the row alignment
    ``row_stride_elems`` gives, ``select`` writing into the piece's rows of ``out``: what a
    benchmark needs to time the kernels alone. ``logits_config`` and ``topk_config`` override
    the kernels' defaults. The keywords ``kv_scale=`` and ``paged=`` of earlier versions raise
    ``TypeError``.

    Returns ``out`` (int32 ``[T, k]``, allocated if not given): per token, kv entries relative
    to its request's first, ``-1`` padded.
    """
    if removed:
        raise _removed_keywords(removed)
    batch = _check_arguments(q, w, query_lens, seq_lens, kv, k=k, compress_ratio=compress_ratio,
                             max_logits_bytes=max_logits_bytes, out=out)
    if out is None:
        out = torch.empty((batch.tokens, k), dtype=torch.int32, device=q.device)
    if batch.tokens == 0:
        return out
    plan = _plan(batch, workspace_size=workspace_size, max_logits_bytes=max_logits_bytes)
    meta = _pack_metadata(batch, plan, group_offsets=isinstance(kv, PagedKV), device=q.device)
    topk_config = topk_config or topk_default_config(
        k, q.device.type, capability(q.device) if q.is_cuda else None)
    scratch = _topk_scratch(plan, device=q.device, config=topk_config)
    timer = _Timer(stats, q.device) if stats is not None else _UNTIMED
    scope = workspace or _arena_scope()
    for rows in plan.empty_rows:
        out[rows].fill_(-1)
    for piece in plan.pieces:
        _run_piece(piece, q=q, w=w, kv=kv, meta=meta, out=out, k=k, scratch=scratch,
                   scope=scope, timer=timer, on_piece=on_piece, logits_config=logits_config,
                   topk_config=topk_config)
    timer.finish()
    return out
