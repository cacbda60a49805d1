"""The indexer logits on Hopper (sm_90): a persistent, warp-specialized Gluon kernel.

Same contract as ``logits.mqa_logits`` / ``paged_mqa_logits``, which dispatch here for bf16,
fp16 and fp8 on sm_90; this module holds the kernel and its launch. The figures behind its
design are in ``docs/indexer-kernels.md``.

Why a second kernel: per head, the logits need ``relu(q_h . kv) * w_h`` summed over heads, and
the relu sits between the product and the head sum. In the portable Triton kernel each
product's result is waited for before its relu, so the tensor cores idle during every relu.
Issuing head h's product asynchronously while running head h - 1's relu does not help: ptxas
serializes every wgmma of a loop that carries one in flight across its back edge. So two or
three consumer warpgroups each run their products synchronously and are never made to wait
for each other: while one runs its relus the other's product keeps the tensor cores busy (the
ping-pong of FlashAttention-3 and CUTLASS).

Partitions of one CTA (one per SM, looping over ``64 x 128 * consumers`` output tiles):

* a producer warp: brings each tile's kv rows (128 per consumer) into one of two buffers, by
  TMA (dense kv) or by ``cp.async`` through the block table (paged kv), with their scales by
  ``cp.async`` and the tile's weights ``[H, 64]`` by TMA; and streams q tiles (``64 x D``,
  one head) through a ``STAGES``-deep TMA ring over q viewed as ``[M, H * D]``; and with
  ``clean``, writes ``-inf`` into the tiles that are skipped (see below);
* two or three consumer warpgroups (``HopperConfig.consumers``), each owning 128 of the
  tile's columns: per head, wait for the q tile, one ``64 x 128 x D`` wgmma, the head's
  weights from shared memory, release the q tile, relu, weight, accumulate. All read the same
  q tile from shared memory, so each q byte fetched from L2 feeds 256 or 384 columns. fp8
  products take half as long as bf16 ones, so two consumers' relus no longer fit under each
  other's products; a third keeps the tensor cores fed.

Both rings (q tiles, kv tiles) hand buffers over with a "full" barrier (the producer's loads
landed) and an "empty" one (every consumer released the buffer); ``_wait_full`` and
``_wait_empty`` hold the slot and phase arithmetic.

The linear half (``HopperConfig.linear_terms = k``, the fp8 default from 32 heads up):
``relu(s) w = (s w + |s| w) / 2``, and summed over the heads the first half is
``q_w . kv / 2`` with ``q_w = sum_h w_h q_h``. ``weighted_q`` writes q_w as k parts in q's
dtype with a row scale; the producer streams them through the q ring ahead of each tile's
heads, and each consumer starts its accumulator as their products (the first part's and the
rest's summed apart in float32: in one wgmma chain the later parts' bits would be lost in
fp8's reduced-precision accumulation). A head then costs one ``FFMA`` an element (``|s|`` is
an operand modifier) instead of an ``FMNMX`` and an ``FFMA``, for k more products a tile; with
k = 3 the logits are as close to the float64 reference as the per-head form's. At 16 heads the
k products cost more than they save; bf16, whose products take twice as long, keeps a relu
per head.

The weights come from shared memory, because their global loads (a row's weight for the next
head, with its address and mask) cost a good part of a head's instructions. ``weighted_q.w_tiles``
writes w transposed (halved for the linear half), with each 16 rows in the order 0, 8, 1, 9,
..., so that the two rows a thread holds in the wgmma layout are one 8-byte shared load. It
costs 2 x H x 64 x 4 bytes of shared memory (32 KiB at 64 heads), which ``supports`` counts.

Tiles wholly outside every row's ``[ks, ke)`` are skipped (and written ``-inf`` when
``clean``). A row block's active tiles are one run of column blocks; counting them row block
by row block, program p takes the p-th, (p + programs)-th, ... active tile, so that every
program computes as many tiles as any other, give or take one (the tile cursor of ``_seek``).
Every partition walks the same sequence. (Striding over all tiles instead, skipping the
inactive ones on the way, leaves the programs of causal rows unevenly loaded.)

With ``clean`` the skipped tiles are walked the same way, and the producer warp writes one
of them a tile (the rest after its last) by TMA stores of a ``-inf`` box in shared memory: a
few instructions of a warp that mostly waits, where the consumers storing them from registers
would stall their products.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from ._device import capability, sm_count
from ._launch import LAUNCH_OPTIONS
from .weighted_q import split_weighted_q, w_tiles

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    AVAILABLE = True
except ImportError:  # pragma: no cover - a Triton without Gluon
    AVAILABLE = False

__all__ = ["AVAILABLE", "HopperConfig", "supports", "usable", "launch"]

BLOCK_M = 64
PART_N = 128             # columns per consumer warpgroup
FILL_ROWS = 8            # the -inf box that ``clean`` copies out: [FILL_ROWS, PART_N] floats

if AVAILABLE:
    # Triton renamed these copies (3.6 has the old names, later versions only the new ones).
    _TMA_LOAD = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _TMA_STORE = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _BARRIER = getattr(gl, "barrier", None) or gl.thread_barrier
    _CP_ASYNC = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    if hasattr(gl.shared_memory_descriptor, "reinterpret"):
        @gluon.jit
        def _reinterpret(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
            return buf.reinterpret(dtype, shape, layout)
    else:  # Triton 3.6 names it with an underscore
        @gluon.jit
        def _reinterpret(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
            return buf._reinterpret(dtype, shape, layout)


@dataclass(frozen=True)
class HopperConfig:
    """``stages``: q tiles (one head each) in flight between the producer and consumers;
    ``consumers``: consumer warpgroups (2 or 3), each owning 128 of the tile's columns;
    ``linear_terms``: 0 for a relu per head and element; k > 0 to take the linear half of the
    relus, ``q_w . kv / 2``, as k tensor-core products of the parts of ``weighted_q`` (one
    ``FFMA`` a head and element instead of an ``FMNMX`` and an ``FFMA``, for k more products
    a tile; the logits then differ from the per-head form by about 2^-(mantissa bits * k)
    of q_w's size, see ``weighted_q``)."""

    stages: int = 4
    consumers: int = 2
    linear_terms: int = 0

    def __post_init__(self):
        if self.stages < 2:
            raise ValueError(f"HopperConfig.stages must be >= 2, got {self.stages}")
        if self.consumers not in (2, 3):
            raise ValueError(f"HopperConfig.consumers must be 2 or 3, got {self.consumers}")
        if self.linear_terms not in range(5):
            raise ValueError(f"HopperConfig.linear_terms must be 0 to 4, got "
                             f"{self.linear_terms}")

    @property
    def block_n(self) -> int:
        return PART_N * self.consumers

    def registers(self) -> tuple[int, int, int]:
        """(maxnreg, consumer worker, producer): 65,536 registers over the warpgroups (the
        producer's warp takes a whole one); the default consumer gets what the workers leave
        of maxnreg times the warpgroups."""
        groups = self.consumers + 1
        maxnreg = 65536 // (128 * groups) // 8 * 8
        producer = 56 if self.consumers == 2 else 32
        consumer = (maxnreg * groups - producer) // self.consumers // 8 * 8
        return maxnreg, consumer, producer

    def __repr__(self) -> str:
        lin = f" linear{self.linear_terms}" if self.linear_terms else ""
        return f"wgmma 64x{self.block_n} s{self.stages}{lin}"


_FP8 = getattr(torch, "float8_e4m3fn", None)
_GL_DTYPE = {}
if AVAILABLE:
    _GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
    if _FP8 is not None:
        _GL_DTYPE[_FP8] = gl.float8e4nv


if AVAILABLE:

    @gluon.jit
    def _add(a, b):
        return a + b

    # ---- the rings' barriers -----------------------------------------------------------------
    # The q tiles and the kv tiles each pass through a ring of buffers, with a "full" and an
    # "empty" barrier per buffer. The index-th fill of a ring of SLOTS buffers uses buffer
    # index % SLOTS, and each lap around the ring completes that buffer's barriers once more.

    @gluon.jit
    def _ring_phase(index, SLOTS: gl.constexpr):
        """The phase (0 or 1) that the barriers of the index-th fill's buffer complete for it."""
        return (index // SLOTS) & 1

    @gluon.jit
    def _wait_full(full, index, SLOTS: gl.constexpr):
        """Waits until the index-th fill of a ring has landed; returns its buffer."""
        slot = index % SLOTS
        mbarrier.wait(full.index(slot), _ring_phase(index, SLOTS))
        return slot

    @gluon.jit
    def _wait_empty(empty, index, SLOTS: gl.constexpr):
        """Waits until the buffer of the index-th fill of a ring is free: its consumers have
        released the previous lap's fill (on the first lap, the phase before a fresh barrier's
        first, which counts as complete); returns the buffer."""
        slot = index % SLOTS
        mbarrier.wait(empty.index(slot), _ring_phase(index, SLOTS) ^ 1)
        return slot

    # ---- the tile walk -----------------------------------------------------------------------

    @gluon.jit
    def _block_ranges(r0, p_ks, p_ke, M, N, BM: gl.constexpr, BN: gl.constexpr,
                      G: gl.constexpr, L: gl.constexpr):
        """For the row blocks r0 .. r0 + G - 1: the column blocks [lo, lo + cnt) that hold a
        column inside some row's [ks, ke) (cnt = 0 for a block with none, or past M)."""
        o_g = r0 + gl.arange(0, G, layout=gl.SliceLayout(1, L))
        o_m = o_g[:, None] * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, L))[None, :]
        m_m = o_m < M
        b_ks = gl.load(p_ks + o_m, mask=m_m, other=0)
        b_ke = gl.load(p_ke + o_m, mask=m_m, other=0)
        m_row = m_m & (b_ke > b_ks)
        n_lo = gl.maximum(gl.min(gl.where(m_row, b_ks, N), axis=1), 0)
        n_hi = gl.max(gl.where(m_row, b_ke, 0), axis=1)
        lo = n_lo // BN
        hi = gl.minimum((n_hi + BN - 1) // BN, gl.cdiv(N, BN))
        return lo, gl.maximum(hi - lo, 0)

    @gluon.jit
    def _seek(target, r, base, lo, cnt, p_ks, p_ke, M, N, BM: gl.constexpr,
              BN: gl.constexpr, ACTIVE: gl.constexpr, NW: gl.constexpr):
        """Moves the tile cursor over the row blocks forward to the one that holds the
        target-th tile of a kind, tiles counted row block by row block: ACTIVE, those with a
        column inside some row's [ks, ke); else the others. The cursor (r, base, lo, cnt): row
        block r, the tiles of the kind in the blocks before it (base), r's active column
        blocks [lo, lo + cnt). r = cdiv(M, BM) once there is no such tile; r = -1 (base, lo,
        cnt 0) starts a walk (_walk_start). Row blocks are read G at a time, so that a long
        way (many row blocks a step when N is short) takes few dependent loads."""
        G: gl.constexpr = 8 * 32 * NW // BM
        L: gl.constexpr = gl.BlockedLayout([1, BM // 32], [1, 32], [NW, 1], [1, 0])
        LG: gl.constexpr = gl.BlockedLayout([G], [32], [NW], [0])
        num_n = gl.cdiv(N, BN)
        num_r = gl.cdiv(M, BM)
        here = gl.where(r < 0, 0, cnt if ACTIVE else num_n - cnt)
        if (r < num_r) & (base + here <= target):
            base += here
            r += 1
            keep = r < num_r
            while keep:
                g_lo, g_cnt = _block_ranges(r, p_ks, p_ke, M, N, BM, BN, G, L)
                # each thread holds all G (a scan across the load's layout is not lowered)
                g_lo = gl.convert_layout(g_lo, LG)
                g_cnt = gl.convert_layout(g_cnt, LG)
                o_g = gl.arange(0, G, layout=LG)
                g_here = g_cnt if ACTIVE else num_n - g_cnt
                g_here = gl.where(r + o_g < num_r, g_here, 0)
                g_incl = gl.associative_scan(g_here, 0, _add)
                # the first of the G blocks whose tiles reach the target (G: none does)
                g = gl.min(gl.where(base + g_incl > target, o_g, G), axis=0)
                base += gl.sum(gl.where(o_g < g, g_here, 0), axis=0)
                lo = gl.sum(gl.where(o_g == g, g_lo, 0), axis=0)
                cnt = gl.sum(gl.where(o_g == g, g_cnt, 0), axis=0)
                r = gl.minimum(r + g, num_r)
                keep = (g == G) & (r < num_r)
        return r, base, lo, cnt

    @gluon.jit
    def _walk_start(target, p_ks, p_ke, M, N, BM: gl.constexpr, BN: gl.constexpr,
                    ACTIVE: gl.constexpr, NW: gl.constexpr):
        """The tile cursor (see _seek) at the target-th tile of a kind, from the walk's start."""
        zero = target * 0
        return _seek(target, zero - 1, zero, zero, zero, p_ks, p_ke, M, N, BM, BN, ACTIVE=ACTIVE,
                     NW=NW)

    @gluon.jit
    def _tile_at(target, r, base, lo, cnt, N, BN: gl.constexpr, ACTIVE: gl.constexpr):
        """The tile (row block * column blocks + column block) that the cursor points at:
        active tiles lie at [lo, lo + cnt) of their row block, the others around them."""
        i = target - base
        if ACTIVE:
            c = lo + i
        else:
            c = gl.where(i < lo, i, i + cnt)
        return r * gl.cdiv(N, BN) + c

    @gluon.jit
    def _run_bounds(r, base, lo, cnt, num_n):
        """The cursor's run of active tiles (r's), as the consumers walk it: the a-th active
        tile is t = a + off while a < end."""
        return r * num_n + lo - base, base + cnt

    @gluon.jit
    def _next_active(t, off, end, step, num_n, rows, BM: gl.constexpr, BN: gl.constexpr,
                     NW: gl.constexpr):
        """The consumers' walk from active tile t to this program's next one, step (the
        number of programs) active tiles on: returns (off, end, t) as _run_bounds defines
        them; once the walk is over, t >= the tiles' count."""
        p_ks, p_ke, M, N = rows
        a = t - off + step
        if a >= end:
            # (as if t's row block had no active tile and `end` before it: the seek moves on
            # from the next one)
            zero = a * 0
            r, base, lo, cnt = _seek(a, t // num_n, end, zero, zero, p_ks, p_ke, M, N, BM, BN,
                                     ACTIVE=True, NW=NW)
            off, end = _run_bounds(r, base, lo, cnt, num_n)
        return off, end, a + off

    # ---- the producer warp -------------------------------------------------------------------

    @gluon.jit
    def _fill_box(inf_smem, NW: gl.constexpr):
        """The -inf box in shared memory that _fill_next copies out, ready for TMA."""
        FILL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
        inf_smem.store(gl.full(inf_smem.type.shape, float("-inf"), gl.float32, FILL))
        fence_async_shared()
        _BARRIER()               # every lane's part of the box is in before one copies it

    @gluon.jit
    def _fill_next(i, r, base, lo, cnt, rows, fill, BM: gl.constexpr, BN: gl.constexpr,
                   NW: gl.constexpr):
        """-inf into the i-th inactive tile (the cursor points at it), by TMA stores of the
        -inf box in shared memory; returns the cursor moved to the (i + programs)-th.
        A TMA store clips a row at a 16-byte boundary, not at its last element, so out_desc
        ends at the last such boundary, n_4, and the columns past it (at most 3, in the last
        column block) are stored one by one."""
        p_ks, p_ke, M, N = rows
        out_desc, inf_smem, p_out, stride_om = fill
        FM: gl.constexpr = inf_smem.type.shape[0]
        FN: gl.constexpr = inf_smem.type.shape[1]
        t = _tile_at(i, r, base, lo, cnt, N, BN, ACTIVE=False)
        num_n = gl.cdiv(N, BN)
        m_0 = (t // num_n) * BM
        n_0 = (t % num_n) * BN
        n_4 = N // 4 * 4
        for c in gl.static_range(BN // FN):
            if n_0 + c * FN < n_4:
                for a in gl.static_range(BM // FM):     # (rows past M are clipped)
                    _TMA_STORE(out_desc, [m_0 + a * FM, n_0 + c * FN], inf_smem)
        if (n_4 < N) & (n_0 + BN >= N):
            TAIL: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [NW, 1], [1, 0])
            o_m = m_0 + gl.arange(0, BM, layout=gl.SliceLayout(1, TAIL))
            o_n = n_4 + gl.arange(0, 4, layout=gl.SliceLayout(0, TAIL))
            gl.store(p_out + o_m.to(gl.int64)[:, None] * stride_om + o_n[None, :],
                     gl.full([BM, 4], float("-inf"), gl.float32, TAIL),
                     mask=(o_m < M)[:, None] & (o_n < N)[None, :])
        i += gl.num_programs(0)
        r, base, lo, cnt = _seek(i, r, base, lo, cnt, p_ks, p_ke, M, N, BM, BN, ACTIVE=False,
                                 NW=NW)
        return i, r, base, lo, cnt

    @gluon.jit
    def _gather_kv(n_0, kv_buf, off_smem, kv_src, N, PAGE: gl.constexpr,
                   CHUNK: gl.constexpr, KV_LOAD: gl.constexpr, ROWS_P: gl.constexpr):
        """cp.async of the 128 paged kv rows from column n_0; returns the rows' pages and
        slots and which rows lie before N. Each row's request is found by a binary search over
        cu_kv, all rows at once; the row offsets go through shared memory to copies in chunks
        (one warp copies 32 KiB at bf16 x 128, chunked to bound registers)."""
        (p_kv, p_kv_scale, p_block_table, p_cu_kv, num_reqs, n_steps, stride_kv_0, stride_kv_1,
         stride_sc_0, stride_sc_1, stride_bt) = kv_src
        PN: gl.constexpr = kv_buf.type.shape[0]
        VEC: gl.constexpr = 16 // (kv_buf.dtype.primitive_bitwidth // 8)
        o_r = n_0 + gl.arange(0, PN, layout=ROWS_P)
        m_r = o_r < N
        # Largest r with cu_kv[r] <= j: with empty requests (repeated starts) that is the one
        # request whose range holds j.
        b_lo = gl.zeros_like(o_r)
        b_hi = gl.zeros_like(o_r) + (num_reqs - 1)
        for _ in range(n_steps):
            b_mid = (b_lo + b_hi + 1) // 2
            b_go = gl.load(p_cu_kv + b_mid) <= o_r
            b_lo = gl.where(b_go, b_mid, b_lo)
            b_hi = gl.where(b_go, b_hi, b_mid - 1)
        b_pos = gl.where(m_r, o_r - gl.load(p_cu_kv + b_lo, mask=m_r, other=0), 0)
        b_page = gl.load(p_block_table + b_lo.to(gl.int64) * stride_bt + b_pos // PAGE,
                         mask=m_r, other=0).to(gl.int64)
        b_slot = (b_pos % PAGE).to(gl.int64)
        # -1 marks rows past N (zero-filled, masked at the store).
        off_smem.store(gl.where(m_r, b_page * stride_kv_0 + b_slot * stride_kv_1, -1))
        o_d = gl.arange(0, kv_buf.type.shape[1], layout=gl.SliceLayout(0, KV_LOAD))
        for c in gl.static_range(PN // CHUNK):
            b_off = off_smem.slice(c * CHUNK, CHUNK).load(gl.SliceLayout(1, KV_LOAD))
            # Rows start 16-byte aligned (the launcher checks base and strides), which lets
            # every cp.async move 16 bytes.
            b_off_ok = gl.multiple_of(gl.maximum(b_off, 0), VEC)
            _CP_ASYNC(kv_buf.slice(c * CHUNK, CHUNK), p_kv + b_off_ok[:, None] + o_d[None, :],
                      mask=(b_off >= 0)[:, None])
        return b_page, b_slot, m_r

    @gluon.jit
    def _load_kv_tile(j, t, num_n, kv_desc, w_desc, kv_ring, off_smem, kv_src, N,
                      NC: gl.constexpr, PAGED: gl.constexpr, PAGE: gl.constexpr,
                      CHUNK: gl.constexpr, KV_LOAD: gl.constexpr):
        """The j-th fill of the kv ring, once its buffer is free: tile t's kv rows (PN per
        consumer; TMA for dense kv, cp.async through the block table for paged), their scales
        (cp.async) and the weights of its rows [H, BM] (TMA). Returns the tile's first row."""
        kv_smem, sc_smem, w_smem, kv_full, kv_empty = kv_ring
        (p_kv, p_kv_scale, p_block_table, p_cu_kv, num_reqs, n_steps, stride_kv_0, stride_kv_1,
         stride_sc_0, stride_sc_1, stride_bt) = kv_src
        BM: gl.constexpr = w_smem.type.shape[2]
        PN: gl.constexpr = kv_smem.type.shape[1]
        BN: gl.constexpr = NC * PN
        NCP: gl.constexpr = kv_smem.type.shape[0] // 2
        NW: gl.constexpr = gl.num_warps()
        ROWS_P: gl.constexpr = gl.BlockedLayout([PN // (32 * NW)], [32], [NW], [0])
        b = _wait_empty(kv_empty, j, 2)
        n_0 = (t % num_n) * BN
        for c in gl.static_range(NC):
            if PAGED:
                b_page, b_slot, m_r = _gather_kv(n_0 + c * PN, kv_smem.index(b * NCP + c),
                                                 off_smem, kv_src, N, PAGE, CHUNK, KV_LOAD,
                                                 ROWS_P)
                off_sc = b_page * stride_sc_0 + b_slot * stride_sc_1
            else:
                o_r = n_0 + c * PN + gl.arange(0, PN, layout=ROWS_P)
                m_r = o_r < N
                off_sc = o_r.to(gl.int64) * stride_sc_0
            _CP_ASYNC(sc_smem.index(b * NCP + c), p_kv_scale + off_sc, mask=m_r)
        # The phase completes once this warp's copies have landed (the async arrive first: it
        # raises the pending count before the arrive below could complete it).
        async_copy.mbarrier_arrive(kv_full.index(b))
        m_0 = (t // num_n) * BM
        # The tile's weights [H, BM] come with its kv, on the kv barrier (the expect is the
        # producer's arrive).
        if PAGED:
            mbarrier.expect(kv_full.index(b), w_desc.block_type.nbytes)
        else:
            mbarrier.expect(kv_full.index(b),
                            NC * kv_desc.block_type.nbytes + w_desc.block_type.nbytes)
            for c in gl.static_range(NC):
                _TMA_LOAD(kv_desc, [n_0 + c * PN, 0], kv_full.index(b),
                          kv_smem.index(b * NCP + c))
        _TMA_LOAD(w_desc, [0, m_0], kv_full.index(b), w_smem.index(b))
        return m_0

    @gluon.jit
    def _load_q(desc, m_0, col, s, q_ring):
        """The s-th fill of the q ring, once its buffer is free: the [BM, D] box of desc at
        (m_0, col), by TMA. Returns s + 1."""
        q_smem, q_full, q_empty = q_ring
        st = _wait_empty(q_empty, s, q_smem.type.shape[0])
        mbarrier.expect(q_full.index(st), desc.block_type.nbytes)
        _TMA_LOAD(desc, [m_0, col], q_full.index(st), q_smem.index(st))
        return s + 1

    @gluon.jit
    def _producer(args, NC: gl.constexpr, PAGED: gl.constexpr, PAGE: gl.constexpr,
                  CHUNK: gl.constexpr, KV_LOAD: gl.constexpr, TERMS: gl.constexpr,
                  CLEAN: gl.constexpr):
        """The producer warp: for each of the program's active tiles, its kv rows, scales and
        weights into the kv ring, then its q tiles (the weighted q's parts, then the heads)
        into the q ring; with CLEAN, -inf into one inactive tile a tile, the rest at the end.
        args: as _logits_ws_kernel names them."""
        (descs, smem, bars, off_smem, p_kv, p_kv_scale, p_block_table, p_cu_kv, fill, rows,
         num_reqs, n_steps, strides) = args
        q_desc, qw_desc, kv_desc, w_desc = descs
        q_smem, kv_smem, sc_smem, w_smem = smem
        q_full, q_empty, kv_full, kv_empty = bars
        q_ring = (q_smem, q_full, q_empty)
        kv_ring = (kv_smem, sc_smem, w_smem, kv_full, kv_empty)
        kv_src = (p_kv, p_kv_scale, p_block_table, p_cu_kv, num_reqs, n_steps) + strides
        p_ks, p_ke, M, N = rows
        out_desc, inf_smem, p_out, stride_om = fill
        BM: gl.constexpr = q_desc.block_type.shape[0]
        D: gl.constexpr = q_desc.block_type.shape[1]
        H: gl.constexpr = w_desc.block_type.shape[0]
        BN: gl.constexpr = NC * kv_smem.type.shape[1]
        NW: gl.constexpr = gl.num_warps()
        num_n = gl.cdiv(N, BN)
        num_r = gl.cdiv(M, BM)
        # The active tiles (a column inside some row's [ks, ke)) counted in order, program p
        # takes the p-th, (p + programs)-th, ...: as many as any other, give or take one.
        a = gl.program_id(0)
        r, base, lo, cnt = _walk_start(a, p_ks, p_ke, M, N, BM, BN, ACTIVE=True, NW=NW)
        if CLEAN:
            # The other tiles get -inf, walked the same way, one a tile while there are active
            # ones, by TMA stores of a -inf box (the module's docstring says why).
            _fill_box(inf_smem, NW)
            i = a
            ri, base_i, lo_i, cnt_i = _walk_start(i, p_ks, p_ke, M, N, BM, BN, ACTIVE=False,
                                                  NW=NW)
        s = 0
        j = 0
        while r < num_r:
            t = _tile_at(a, r, base, lo, cnt, N, BN, ACTIVE=True)
            m_0 = _load_kv_tile(j, t, num_n, kv_desc, w_desc, kv_ring, off_smem, kv_src, N,
                                NC, PAGED, PAGE, CHUNK, KV_LOAD)
            if CLEAN:
                if ri < num_r:
                    i, ri, base_i, lo_i, cnt_i = _fill_next(i, ri, base_i, lo_i, cnt_i, rows,
                                                            fill, BM, BN, NW)
            # The parts of the weighted q first (when the linear half is taken apart), then
            # the heads, all through the one ring.
            for k in gl.static_range(TERMS):
                s = _load_q(qw_desc, m_0, k * D, s, q_ring)
            for h in range(H):
                s = _load_q(q_desc, m_0, h * D, s, q_ring)
            a += gl.num_programs(0)
            r, base, lo, cnt = _seek(a, r, base, lo, cnt, p_ks, p_ke, M, N, BM, BN, ACTIVE=True,
                                     NW=NW)
            j += 1
        if CLEAN:
            while ri < num_r:
                i, ri, base_i, lo_i, cnt_i = _fill_next(i, ri, base_i, lo_i, cnt_i, rows, fill,
                                                        BM, BN, NW)
            tma.store_wait(0)      # the box must outlive the copies that read it

    # ---- the consumer warpgroups -------------------------------------------------------------

    @gluon.jit
    def _linear_half(q_ring, kv_t, s, acc, b_s, p_row_scale, o_m, m_m, TERMS: gl.constexpr):
        """row_scale * (sum_k part_k . kv) / 2 into acc, from the q ring's s-th fill on;
        returns (acc, b_s, the next fill's index). The first part's product and the later
        parts' are summed apart, in float32: fp8 products accumulate in reduced precision
        relative to the running sum, so in one sum with the first part the later, smaller
        parts would lose their low bits."""
        q_smem, q_full, q_empty = q_ring
        STAGES: gl.constexpr = q_smem.type.shape[0]
        for k in gl.static_range(TERMS):
            st = _wait_full(q_full, s, STAGES)
            if k == 0:
                acc = warpgroup_mma(q_smem.index(st), kv_t, acc, use_acc=False)
            else:
                b_s = warpgroup_mma(q_smem.index(st), kv_t, b_s, use_acc=k > 1)
            mbarrier.arrive(q_empty.index(st), count=1)
            s += 1
        if TERMS > 1:
            acc += b_s
        b_half = gl.load(p_row_scale + o_m, mask=m_m, other=0.0) * 0.5
        return acc * b_half[:, None], b_s, s

    @gluon.jit
    def _store_tile(acc, b, t, num_n, kv_ring, rows, p_out, stride_om, o_m, m_m,
                    NC: gl.constexpr, PART: gl.constexpr, COLS: gl.constexpr):
        """Releases the kv ring's buffer b and stores this consumer's columns of tile t:
        acc times the kv rows' scales inside each row's [ks, ke), -inf elsewhere."""
        kv_smem, sc_smem, w_smem, kv_full, kv_empty = kv_ring
        p_ks, p_ke, M, N = rows
        PN: gl.constexpr = kv_smem.type.shape[1]
        NCP: gl.constexpr = kv_smem.type.shape[0] // 2
        BN: gl.constexpr = NC * PN
        o_n = (t % num_n) * BN + PART * PN + gl.arange(0, PN, layout=COLS)
        b_scale = sc_smem.index(b * NCP + PART).load(COLS)
        mbarrier.arrive(kv_empty.index(b), count=1)
        b_ks = gl.load(p_ks + o_m, mask=m_m, other=0)
        b_ke = gl.load(p_ke + o_m, mask=m_m, other=0)
        m_in = (o_n[None, :] >= b_ks[:, None]) & (o_n[None, :] < b_ke[:, None])
        b_out = gl.where(m_in, acc * b_scale[None, :], float("-inf"))
        gl.store(p_out + o_m.to(gl.int64)[:, None] * stride_om + o_n[None, :], b_out,
                 mask=m_m[:, None] & (o_n < N)[None, :])

    @gluon.jit
    def _consumer(args, NC: gl.constexpr, PART: gl.constexpr, TERMS: gl.constexpr,
                  W_ROW: gl.constexpr):
        """Consumer warpgroup PART of NC: columns [PART * PN, (PART + 1) * PN) of every tile
        the producer loads, one wgmma and one weighted relu a head. args: as
        _logits_ws_kernel names them."""
        smem, bars, p_ks, p_ke, p_out, p_row_scale, M, N, stride_om = args
        q_smem, kv_smem, sc_smem, w_smem = smem
        q_full, q_empty, kv_full, kv_empty = bars
        q_ring = (q_smem, q_full, q_empty)
        kv_ring = (kv_smem, sc_smem, w_smem, kv_full, kv_empty)
        rows = (p_ks, p_ke, M, N)
        NW: gl.constexpr = gl.num_warps()
        STAGES: gl.constexpr = q_smem.type.shape[0]
        BM: gl.constexpr = q_smem.type.shape[1]
        H: gl.constexpr = w_smem.type.shape[1]
        PN: gl.constexpr = kv_smem.type.shape[1]
        NCP: gl.constexpr = kv_smem.type.shape[0] // 2
        BN: gl.constexpr = NC * PN
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[NW, 1],
            instr_shape=[16, PN, 256 // q_smem.dtype.primitive_bitwidth])
        ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
        COLS: gl.constexpr = gl.SliceLayout(0, MMA)
        num_n = gl.cdiv(N, BN)
        num_r = gl.cdiv(M, BM)
        step = gl.num_programs(0)
        # The product's accumulator input is ignored (use_acc=False); passing the previous,
        # dead product lets the new one take its registers instead of holding a zero tile.
        b_s = gl.zeros([BM, PN], gl.float32, MMA)
        # The producer's walk over the active tiles, with less to carry across the product
        # loop (_run_bounds).
        a = gl.program_id(0)
        r, base, lo, cnt = _walk_start(a, p_ks, p_ke, M, N, BM, BN, ACTIVE=True, NW=NW)
        off, end = _run_bounds(r, base, lo, cnt, num_n)
        t = a + off
        s = 0
        while t < num_r * num_n:
            j = s // (H + TERMS)         # tiles done: one register less across the products
            b = _wait_full(kv_full, j, 2)
            # Paged kv rows came through cp.async (generic proxy); wgmma reads through the
            # async proxy.
            fence_async_shared()
            kv_t = kv_smem.index(b * NCP + PART).permute((1, 0))
            o_m = (t // num_n) * BM + gl.arange(0, BM, layout=ROWS)
            m_m = o_m < M
            # one head's weights for the tile's rows, a thread's two rows side by side
            w_heads = _reinterpret(w_smem.index(b), gl.float32, [H, BM], W_ROW)
            acc = gl.zeros([BM, PN], gl.float32, MMA)
            if TERMS > 0:
                acc, b_s, s = _linear_half(q_ring, kv_t, s, acc, b_s, p_row_scale, o_m, m_m,
                                           TERMS)
            for h in range(H):
                st = _wait_full(q_full, s, STAGES)
                b_s = warpgroup_mma(q_smem.index(st), kv_t, b_s, use_acc=False)
                b_w = w_heads.index(h).load(ROWS)
                mbarrier.arrive(q_empty.index(st), count=1)
                if TERMS > 0:
                    # relu(s) * w = s * w/2 + |s| * w/2; the first half is in acc already
                    # and the weights come halved.
                    acc += gl.abs(b_s) * b_w[:, None]
                else:
                    acc += gl.maximum(b_s, 0.0) * b_w[:, None]
                s += 1
            _store_tile(acc, b, t, num_n, kv_ring, rows, p_out, stride_om, o_m, m_m, NC, PART,
                        COLS)
            off, end, t = _next_active(t, off, end, step, num_n, rows, BM, BN, NW)

    @gluon.jit
    def _logits_ws_kernel(q_desc, qw_desc, kv_desc, w_desc, out_desc, p_kv, p_kv_scale, p_ks, p_ke,
                          p_out, p_row_scale, p_block_table, p_cu_kv, M, N, num_reqs, n_steps,
                          stride_kv_0, stride_kv_1, stride_sc_0, stride_sc_1, stride_om,
                          stride_bt, H: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                          NC: gl.constexpr, PAGED: gl.constexpr, PAGE: gl.constexpr,
                          CLEAN: gl.constexpr, KV_SMEM: gl.constexpr, KV_LOAD: gl.constexpr,
                          CHUNK: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          PRODUCER_REGS: gl.constexpr, TERMS: gl.constexpr,
                          W_ROW: gl.constexpr):
        BM: gl.constexpr = q_desc.block_type.shape[0]
        PN: gl.constexpr = 128
        NCP: gl.constexpr = 2 if NC <= 2 else 4          # buffers per tile, a power of two
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BM, D], q_desc.layout)
        kv_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * NCP, PN, D], KV_SMEM)
        sc_smem = gl.allocate_shared_memory(gl.float32, [2 * NCP, PN], plain)
        off_smem = gl.allocate_shared_memory(gl.int64, [PN if PAGED else 1], plain)
        w_smem = gl.allocate_shared_memory(gl.float32, [2] + w_desc.block_type.shape,
                                           w_desc.layout)
        q_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        if CLEAN:
            inf_smem = gl.allocate_shared_memory(gl.float32, out_desc.block_type.shape,
                                                 out_desc.layout)
        else:
            inf_smem = off_smem          # unused
        for i in gl.static_range(STAGES):
            mbarrier.init(q_full.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=NC)     # one arrive per consumer
        for i in gl.static_range(2):
            mbarrier.init(kv_full.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=NC)
        descs = (q_desc, qw_desc, kv_desc, w_desc)
        smem = (q_smem, kv_smem, sc_smem, w_smem)        # the rings' buffers
        bars = (q_full, q_empty, kv_full, kv_empty)      # and their barriers
        fill = (out_desc, inf_smem, p_out, stride_om)    # where -inf goes (with CLEAN)
        rows = (p_ks, p_ke, M, N)
        strides = (stride_kv_0, stride_kv_1, stride_sc_0, stride_sc_1, stride_bt)
        # Each partition takes its values as one tuple, and its constexprs apart (a tuple held
        # in a variable holds values only).
        consumer_args = (smem, bars, p_ks, p_ke, p_out, p_row_scale, M, N, stride_om)
        producer_args = (descs, smem, bars, off_smem, p_kv, p_kv_scale, p_block_table, p_cu_kv,
                         fill, rows, num_reqs, n_steps, strides)
        # (a jit function cannot be put in a variable here, so the partitions are spelled out
        # for each count of consumers)
        if NC == 2:
            gl.warp_specialize([
                (_consumer, (consumer_args, NC, gl.constexpr(0), TERMS, W_ROW)),
                (_consumer, (consumer_args, NC, gl.constexpr(1), TERMS, W_ROW)),
                (_producer, (producer_args, NC, PAGED, PAGE, CHUNK, KV_LOAD, TERMS, CLEAN)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (consumer_args, NC, gl.constexpr(0), TERMS, W_ROW)),
                (_consumer, (consumer_args, NC, gl.constexpr(1), TERMS, W_ROW)),
                (_consumer, (consumer_args, NC, gl.constexpr(2), TERMS, W_ROW)),
                (_producer, (producer_args, NC, PAGED, PAGE, CHUNK, KV_LOAD, TERMS, CLEAN)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


_SMEM_LIMIT = 227 * 1024


def supports(dtype: torch.dtype, h: int, d: int, cfg: HopperConfig) -> bool:
    """Whether the kernel exists for this dtype and shape: 16-bit or fp8, D a power of two
    from 32, at most 256 heads, with all the kernel keeps in shared memory in it."""
    if not AVAILABLE or dtype not in _GL_DTYPE or d < 32 or d & (d - 1) or not 1 <= h <= 256:
        return False
    elem = 1 if dtype == _FP8 else 2
    buffers = 2 * (2 if cfg.consumers <= 2 else 4)
    nbytes = ((cfg.stages * BLOCK_M + buffers * PART_N) * d * elem  # q ring, kv rows
              + buffers * PART_N * 4                # kv scales
              + PART_N * 8                          # paged kv: the rows' offsets
              + 2 * h * BLOCK_M * 4                 # weights
              + FILL_ROWS * PART_N * 4              # the -inf box
              + 1024)                               # barriers, alignment
    return nbytes <= _SMEM_LIMIT


def usable(q: torch.Tensor, kv: torch.Tensor, strides_kv: tuple[int, int], out: torch.Tensor,
           cfg: HopperConfig) -> bool:
    """Whether the kernel can take these inputs: ``supports``, on an sm_90 device, q viewable
    as [M, H * D] with a 16-byte aligned base and row stride (for TMA), kv rows (dense, or
    pages and slots of a cache) starting 16-byte aligned (for TMA and cp.async), and ``out``
    16-byte aligned (its -inf tiles are TMA stores; its row stride is checked by the caller)."""
    _, h, d = q.shape
    if q.device.type != "cuda" or not supports(q.dtype, h, d, cfg):
        return False
    if capability(q.device) != (9, 0):
        return False
    elem = q.element_size()
    return (q.stride(1) == d and q.stride(2) == 1 and q.data_ptr() % 16 == 0
            and (q.stride(0) * elem) % 16 == 0 and kv.data_ptr() % 16 == 0
            and all((st * elem) % 16 == 0 for st in strides_kv) and out.data_ptr() % 16 == 0)


@functools.lru_cache(maxsize=None)
def layouts(dtype, d: int):
    """Shared layouts (q tile, a consumer's kv rows) and the producer warp's paged copy: rows
    per chunk (eight 16-byte copies a thread) and its layout."""
    gdt = _GL_DTYPE[dtype]
    vec = 128 // gdt.primitive_bitwidth        # elements per 16-byte cp.async
    tpw_d = min(32, d // vec)
    chunk = min(PART_N, 256 * vec // d)
    kv_load = gl.BlockedLayout([1, vec], [32 // tpw_d, tpw_d], [1, 1], [1, 0])
    kv_smem = gl.NVMMASharedLayout.get_default_for([PART_N, d], gdt)
    q_smem = gl.NVMMASharedLayout.get_default_for([BLOCK_M, d], gdt)
    return q_smem, kv_smem, kv_load, chunk


@functools.lru_cache(maxsize=None)
def w_layouts():
    """The weights' tile [H, BLOCK_M] as TMA writes it (rows of BLOCK_M floats, unswizzled) and
    as the consumers read one head's row of it: a rank-1 layout whose offset bits map to rows
    8, 1, 2, 4, 16, 32, ..., the order ``w_tiles`` stored them in, so that the two rows r and
    r + 8 a thread holds in the wgmma layout are one 8-byte load."""
    tma = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    rows = [[8], [1], [2], [4]] + [[1 << i] for i in range(4, (BLOCK_M - 1).bit_length())]
    return tma, gl.SharedLinearLayout(rows)


def launch(q, kv, kv_scale, w, ks, ke, out, block_table, cu_kv, num_reqs, n_steps, paged, page,
           strides_kv, strides_sc, stride_bt, clean, cfg: HopperConfig):
    m, h, d = q.shape
    n = out.shape[1]
    q_smem, kv_smem, kv_load, chunk = layouts(q.dtype, d)
    q2 = q.as_strided((m, h * d), (q.stride(0), 1))
    q_desc = TensorDescriptor(q2, [m, h * d], [q.stride(0), 1], [BLOCK_M, d], q_smem)
    terms = cfg.linear_terms
    if terms:
        parts, row_scale = split_weighted_q(q, w, terms)
        qw_desc = TensorDescriptor(parts, [m, terms * d], [parts.stride(0), 1], [BLOCK_M, d],
                                   q_smem)
    else:
        qw_desc, row_scale = q_desc, w          # unused
    w_tma, w_row = w_layouts()
    wt = w_tiles(w, 0.5 if terms else 1.0, BLOCK_M)
    w_desc = TensorDescriptor(wt, list(wt.shape), [wt.stride(0), 1], [h, BLOCK_M], w_tma)
    # Up to the last 16-byte boundary of a row (see _fill_next); a single row's stride is
    # any, TMA only wants one that is a multiple of 16 bytes.
    stride_om = out.stride(0) if m > 1 else -(-n // 4) * 4
    out_desc = TensorDescriptor(out, [m, max(n // 4 * 4, 4)], [stride_om, 1],
                                [FILL_ROWS, PART_N], w_tma)
    if paged:
        kv_desc = q_desc          # unused: paged rows are gathered with cp.async
    else:
        kv_desc = TensorDescriptor(kv, [kv.shape[0], d], [strides_kv[0], 1], [PART_N, d],
                                   kv_smem)
    sms = sm_count(q.device)
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, cfg.block_n)
    maxnreg, consumer_regs, producer_regs = cfg.registers()
    _logits_ws_kernel[(min(tiles, sms),)](
        q_desc, qw_desc, kv_desc, w_desc, out_desc, kv, kv_scale, ks, ke, out, row_scale,
        block_table, cu_kv, m, n, num_reqs, n_steps,
        strides_kv[0], strides_kv[1], strides_sc[0], strides_sc[1], out.stride(0), stride_bt,
        H=h, D=d, STAGES=cfg.stages, NC=cfg.consumers, PAGED=paged, PAGE=page, CLEAN=clean,
        KV_SMEM=kv_smem, KV_LOAD=kv_load, CHUNK=chunk, CONSUMER_REGS=consumer_regs,
        PRODUCER_REGS=producer_regs, TERMS=terms, W_ROW=w_row, num_warps=4, maxnreg=maxnreg,
        **LAUNCH_OPTIONS)
    return out
