"""Per-row top-k over float32 logits in Triton: a histogram radix select that reads most rows once.

For row i the kernel returns the indices (relative to ``ks[i]``) of the ``k`` largest entries
of ``logits[i, ks[i]:ke[i]]``, ``-1`` padding rows shorter than k. Order within a row is not by
value; the set is exact, and ties at the threshold go to the lowest indices.

Every comparison is on an order-preserving integer key (the float's bits with the magnitude
flipped for negatives, so -0.0 sorts just below +0.0 and the infinities at the ends). A row is
cut into key bins, the bin holding the k-th largest key is found from exact counts, and only
that bin's entries are examined further. One persistent program works on one row at a time:

1. ``L = ke - ks <= k``: write ``0..L-1`` and ``-1``s (``PATH_SHORT``).
2. ``L <= min(CAND, 2 S)`` (see 3): the whole row is the candidate list of step 6, one read
   (``PATH_DIRECT``).
3. Window: a jittered sample of ``S = RUNS x RUN`` entries and three 32-bin histogram rounds
   on its keys give the key range of the sample ranks ``r -/+ Z sqrt(r)`` around the k-th
   largest's expected rank ``r = k S / L``. It places pass 1's bins and the threshold of
   what pass 1 collects; nothing depends on it being right.
4. Pass 1 (read 1): count the row into 8 key bins, 6 across the window and one open bin at
   each end. From these exact counts a suffix sum gives the threshold bin b* (the last bin
   whose suffix holds >= k entries) and the number of entries above it. With ``sampled``
   (the default) the pass also collects every entry at or above the window's floor, as a
   (key, index) pair, into the program's list in scratch. If b* lies at or above the floor
   and the list held them all, the list has b* and everything above it: one read
   (``PATH_SAMPLED``; most rows of normal logits).
5. Otherwise pass 2 (read 2, from the row's end, so that it starts on what pass 1 left in
   L2) collects every entry whose key is at least b*'s lower edge: fewer than k above b*
   plus b*'s own entries (``PATH_RADIX``).
6. Select, from the list: entries above b* go to the output; b*'s entries are compacted to
   the list's front (those below b* dropped) and narrowed by 32-bin histograms on their keys
   (5 bits a round, no bisection) to the exact threshold key T and the number of its ties
   the top k takes; if that is fewer than there are, the same rounds on the ties' indices
   find the index cut. Then the entries above T and the ties up to the cut go to the output.
7. If b*'s entries do not fit in ``CAND``, pass 1 runs again with its bins spread over b*
   alone (each pass cuts the key range at least 3-fold, typically 6-fold) until they fit
   (``PATH_REFINED``), or until b* is a single key whose ties overflow: then one last pass
   writes the entries above it and the first ties in index order (``PATH_TIES``). Correct
   for any input without NaNs, only slower.

Why pass 1 does not use ``tl.histogram`` with 2048 bins (the digit of an 11-bit radix pass):
Triton releases that lower it to one warp ballot per bin-index bit plus one popcount per bin
owned by each lane make it hundreds of instructions an entry (and still dozens at 64 bins),
and the kernel must be fast on those too. So pass 1 counts, per thread, into 8 byte-wide
fields of one int64: adding ``1 << 8 bin`` is two instructions an
entry, about 12 in all with the bin's computation; the fields are widened to 16 bits once a
block and summed across the threads once a row. Eight bins are coarse; the sample window is
what makes them land around the threshold. ``tl.histogram`` is still used where few keys go
through it (the sample and the candidate rounds).

Why the rest looks the way it does. A kernel whose steps are block-wide reductions is
latency-bound at the few programs an SM that its registers allow. Here pass 1 has no step
across threads until the row's end, pass 2 one scan and one sum a block, the selection a few
dozen, and registers (capped by ``programs_per_sm``: 128 a thread at the default 4) leave
room for 4 programs of 4 warps an SM, so that one program's serial selection overlaps the
others' streaming. The passes' loads are unmasked 16-byte vectors except in two edge
blocks, pipelined through shared memory (cp.async). Per block, what would be a block-wide
scan runs as per-thread work plus one scan of a count per thread (which is why the list is
not in index order, and why the selection breaks ties by index itself). When the bins lie
above zero (the usual case for top-k logits) both passes compare the raw float bits as
integers, which order the same as the keys there, and skip the key transform.

The figures behind these choices and behind ``TopkConfig``'s defaults (list sizes, rates, the
histogram's lowering): ``docs/indexer-kernels.md``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ._device import capability, family, family_of, sm_count
from ._launch import LAUNCH_OPTIONS

__all__ = ["TopkConfig", "top_k_per_row", "default_config", "sweep_configs", "scratch_elems",
           "max_registers", "path_counts"]

INT32_MIN = tl.constexpr(-(2**31))
INT32_MAX = tl.constexpr(2**31 - 1)
PASS_BINS = tl.constexpr(8)       # bins of a row pass: 8-bit fields of one int64
ROUND_BINS = tl.constexpr(32)     # bins of a sample or candidate round (tl.histogram)

PATH_SHORT, PATH_DIRECT, PATH_RADIX, PATH_REFINED, PATH_TIES, PATH_SAMPLED = 0, 1, 2, 3, 4, 5
PATH_STREAM = 6
"""Values of the per-row path record: at most k entries; whole row as the candidate list (one
read); threshold bin found by pass 1, its entries collected by pass 2 (two reads);
pass 1 repeated on the threshold bin (three reads or more); threshold bin a single key with
more ties than fit, written by a tie pass; the sample's threshold held (one read); with
``TopkConfig.stream``, the row's segments collected what lies above the sample's floor, the
sample's window held the k-th largest and the list at most ``cand`` entries (one read; a row
where it did not takes the other paths)."""
PATH_NAMES = ("short", "direct", "radix", "refined", "ties", "sampled", "stream")
_DIRECT = tl.constexpr(PATH_DIRECT)
_RADIX = tl.constexpr(PATH_RADIX)
_REFINED = tl.constexpr(PATH_REFINED)
_TIES = tl.constexpr(PATH_TIES)
_SAMPLED = tl.constexpr(PATH_SAMPLED)
_STREAM = tl.constexpr(PATH_STREAM)


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _float_key(b_bits):
    # float32 bits (as int32) -> int32 whose signed order is the float order (-0.0 just below
    # +0.0): negative floats have their magnitude bits flipped. Bits -1 (a NaN, never a valid
    # entry) map to INT32_MIN, below every valid key; masked lanes use that.
    return b_bits ^ ((b_bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _shift_for(span, BOUND: tl.constexpr):
    """Smallest s >= 0 with (span >> s) < BOUND, for an int64 span in [0, 2**40)."""
    s = span * 0
    for i in tl.static_range(6):
        t = s + (32 >> i)
        s = tl.where((span >> t) >= BOUND, t, s)
    return tl.where(span >= BOUND, s + 1, s * 0).to(tl.int32)


@triton.jit
def _bin(b_key, base, shift, NB: tl.constexpr):
    """Bin j holds keys in [base + j 2**shift, base + (j+1) 2**shift); bin 0 also everything
    below and bin NB-1 everything above. base is an int32 scalar; returns uint32."""
    b_u = (tl.maximum(b_key, base) - base).to(tl.uint32, bitcast=True)
    return tl.minimum(b_u >> shift.to(tl.uint32), tl.full([], NB - 1, tl.uint32))


@triton.jit
def _pair(b_key, b_idx):
    return (b_key.to(tl.int64) << 32) | b_idx.to(tl.uint32, bitcast=True).to(tl.int64)


# The row passes split [ks, ke) into full blocks starting at ks rounded up to 16 entries (so
# every one is 64-byte aligned and loads unmasked, which is what lets Triton vectorize it and
# pipeline it through shared memory with cp.async) and at most two masked edge blocks: the
# head [ks, a) and the tail [t, ke). Masked lanes read as bits -1, whose key is below every
# valid key.
#
# Inside a block, work that would be a block-wide scan or sum is split into what each thread
# does alone and one step across threads: a block of BLOCK entries is viewed as [R, T, 4],
# T threads each holding R vectors of 4 consecutive entries (the layout of a vectorized
# load), so reducing over the first and last axes never leaves a thread.

@triton.jit
def _main_range(ks, ke, BLOCK: tl.constexpr):
    a = (ks + 15) // 16 * 16
    n_full = tl.maximum(ke - a, 0) // BLOCK
    return a, n_full, a + n_full * BLOCK


@triton.jit
def _masked_bits(p_base, start, lo, hi, BLOCK: tl.constexpr):
    o_x = start + tl.arange(0, BLOCK)
    m_x = (o_x >= lo) & (o_x < hi)
    b_bits = tl.load(p_base + o_x, mask=m_x, other=0.0).to(tl.int32, bitcast=True)
    return o_x, tl.where(m_x, b_bits, -1)


@triton.jit
def _halves(x, B: tl.constexpr):
    """The first and the second half of a block (each thread's vectors split between them)."""
    return tl.split(tl.permute(tl.reshape(x, [2, B // 2]), [1, 0]))


@triton.jit
def _quarters(x, T: tl.constexpr):
    """Of a block of 4T entries, entries 0, 1, 2 and 3 of every vector of 4 (one vector per
    thread), each as a [T] tensor."""
    xa, xb = tl.split(tl.reshape(x, [T, 2, 2]))
    x0, x2 = tl.split(xa)
    x1, x3 = tl.split(xb)
    return x0, x1, x2, x3


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _bin_counts(b_bits, base, shift, KEYS: tl.constexpr, BLOCK: tl.constexpr,
                T: tl.constexpr):
    """Per thread, its entries' counts in the PASS_BINS bins as byte fields of an int64."""
    b_key = b_bits
    if KEYS:
        b_key = _float_key(b_bits)
    b_fld = _bin(b_key, base, shift, NB=PASS_BINS) * 8
    b_one = tl.full([BLOCK], 1, tl.int64) << b_fld.to(tl.int64)
    return tl.sum(tl.sum(tl.reshape(b_one, [BLOCK // (4 * T), T, 4]), 2), 0)


@triton.jit
def _widen(b_cnt):
    """Byte-field counts (bins 0..7) as two int64 of 16-bit fields: even and odd bins."""
    return b_cnt & 0x00FF00FF00FF00FF, (b_cnt >> 8) & 0x00FF00FF00FF00FF


@triton.jit
def _fold_bins(acc_e, acc_o):
    """Sum the 16-bit-field counters across threads: word j holds bins j and j+4 in its
    halves."""
    return tl.reduce((acc_e & 0x0000FFFF0000FFFF, acc_o & 0x0000FFFF0000FFFF,
                      (acc_e >> 16) & 0x0000FFFF0000FFFF, (acc_o >> 16) & 0x0000FFFF0000FFFF),
                     0, _add4)


@triton.jit
def _hist_pass(p_base, ks, ke, base, shift, thr, p_list, KEYS: tl.constexpr,
               COLLECT: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr, T: tl.constexpr,
               STAGES: tl.constexpr):
    """Pass 1: counts of row[ks:ke] (plus the masked lanes, in bin 0) in PASS_BINS bins of
    _bin(key, base, shift). KEYS=False compares the raw bits instead of the keys (the same
    order for every bin when base >= 0). With COLLECT, the pass also does pass 2's work for
    threshold thr (_collect_block) in the same read. Returns int32 [PASS_BINS] and the
    number of entries collected."""
    # A thread counts a block's entries in 8 byte-wide fields of one int64 (adding a shifted
    # 1 is two instructions an entry; a block adds at most 4R = BLOCK / T to a field) and
    # then adds them, even and odd bins apart, to 16-bit fields, which overflow only after
    # FOLD blocks: the counters are summed across the threads once per FOLD blocks (once a
    # row unless it is millions of entries long), so the pipelined loop rarely restarts.
    FOLD: tl.constexpr = 65535 * T // BLOCK
    a, n_full, t = _main_range(ks, ke, BLOCK)
    acc_e = tl.zeros([T], tl.int64)
    acc_o = tl.zeros([T], tl.int64)
    n_done = ks * 0
    if ks < a:
        o_x, b_bits = _masked_bits(p_base, a - 16, ks, tl.minimum(a, ke), BLOCK)
        w_e, w_o = _widen(_bin_counts(b_bits, base, shift, KEYS, BLOCK, T))
        acc_e += w_e
        acc_o += w_o
        if COLLECT:
            n_done = _collect_block(o_x, b_bits, ks, thr, n_done, p_list, p_list, KEYS, False,
                                        CAP, BLOCK, T)
    if t < ke:
        o_x, b_bits = _masked_bits(p_base, t, t, ke, BLOCK)
        w_e, w_o = _widen(_bin_counts(b_bits, base, shift, KEYS, BLOCK, T))
        acc_e += w_e
        acc_o += w_o
        if COLLECT:
            n_done = _collect_block(o_x, b_bits, ks, thr, n_done, p_list, p_list, KEYS, False,
                                        CAP, BLOCK, T)
    t0, t1, t2, t3 = _fold_bins(acc_e, acc_o)
    o_b = tl.arange(0, BLOCK)
    for g in range(0, n_full, FOLD):
        acc_e = tl.zeros([T], tl.int64)
        acc_o = tl.zeros([T], tl.int64)
        for i in tl.range(g, tl.minimum(g + FOLD, n_full), num_stages=STAGES):
            o_x = (a + i * BLOCK) + o_b
            b_bits = tl.load(p_base + o_x).to(tl.int32, bitcast=True)
            w_e, w_o = _widen(_bin_counts(b_bits, base, shift, KEYS, BLOCK, T))
            acc_e += w_e
            acc_o += w_o
            if COLLECT:
                n_done = _collect_block(o_x, b_bits, ks, thr, n_done, p_list, p_list, KEYS,
                                        False, CAP, BLOCK, T)
        w0, w1, w2, w3 = _fold_bins(acc_e, acc_o)
        t0 += w0
        t1 += w1
        t2 += w2
        t3 += w3
    # word 0: bins 0 and 4, word 1: bins 1 and 5, word 2: bins 2 and 6, word 3: 3 and 7
    j = tl.arange(0, PASS_BINS)
    j4 = j % 4
    h = tl.where(j4 == 0, t0, tl.where(j4 == 1, t1, tl.where(j4 == 2, t2, t3)))
    return tl.where(j < 4, h & 0xFFFFFFFF, h >> 32).to(tl.int32), n_done


@triton.jit
def _piece_count(b_key, thr, T: tl.constexpr):
    k0, k1, k2, k3 = _quarters(b_key, T)
    return ((k0 >= thr).to(tl.int32) + (k1 >= thr).to(tl.int32) + (k2 >= thr).to(tl.int32)
            + (k3 >= thr).to(tl.int32))


@triton.jit
def _piece_store(b_key, b_idx, thr, o_l, p_list, CAP: tl.constexpr, T: tl.constexpr):
    # Slots past CAP are not written (the count goes on): the caller sees the overflow.
    k0, k1, k2, k3 = _quarters(b_key, T)
    i0, i1, i2, i3 = _quarters(b_idx, T)
    tl.store(p_list + o_l, _pair(k0, i0), mask=(k0 >= thr) & (o_l < CAP))
    o_l += (k0 >= thr).to(tl.int32)
    tl.store(p_list + o_l, _pair(k1, i1), mask=(k1 >= thr) & (o_l < CAP))
    o_l += (k1 >= thr).to(tl.int32)
    tl.store(p_list + o_l, _pair(k2, i2), mask=(k2 >= thr) & (o_l < CAP))
    o_l += (k2 >= thr).to(tl.int32)
    tl.store(p_list + o_l, _pair(k3, i3), mask=(k3 >= thr) & (o_l < CAP))
    return o_l + (k3 >= thr).to(tl.int32)


@triton.jit
def _slots(n_done, b_cnt, p_cnt, ATOMIC: tl.constexpr):
    """Each thread's first list slot: after those of the threads before it, from n_done on, or
    with ATOMIC from the slots reserved at p_cnt (other programs fill the same list)."""
    base = n_done
    if ATOMIC:
        # p_cnt: the row's int64 counter, slots taken in its low half (_collect_pass)
        old = tl.atomic_add(p_cnt, tl.sum(b_cnt).to(tl.int64), sem="relaxed")
        base = (old & 0xFFFFFFFF).to(tl.int32)
    return base + tl.cumsum(b_cnt, 0) - b_cnt


@triton.jit
def _collect_block(o_x, b_bits, ks, thr, n_done, p_list, p_cnt, KEYS: tl.constexpr,
                   ATOMIC: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
                   T: tl.constexpr):
    b_key = b_bits
    if KEYS:
        b_key = _float_key(b_bits)
    b_idx = o_x - ks
    # Each thread writes its selected entries to consecutive slots after those of the
    # threads before it, so the only steps across threads are one scan and one sum of a
    # count per thread. (The list is therefore not in index order; the selection breaks ties
    # by index itself.) A block is 1, 2 or 4 pieces of one vector of 4 per thread.
    R: tl.constexpr = BLOCK // (4 * T)
    if R == 1:
        b_cnt = _piece_count(b_key, thr, T)
        _piece_store(b_key, b_idx, thr, _slots(n_done, b_cnt, p_cnt, ATOMIC), p_list, CAP, T)
    elif R == 2:
        ka, kb = _halves(b_key, BLOCK)
        ia, ib = _halves(b_idx, BLOCK)
        b_cnt = _piece_count(ka, thr, T) + _piece_count(kb, thr, T)
        o_l = _slots(n_done, b_cnt, p_cnt, ATOMIC)
        o_l = _piece_store(ka, ia, thr, o_l, p_list, CAP, T)
        _piece_store(kb, ib, thr, o_l, p_list, CAP, T)
    else:
        tl.static_assert(R == 4, "a pass-2 block is 1, 2 or 4 vectors of 4 a thread")
        ka, kb = _halves(b_key, BLOCK)
        ia, ib = _halves(b_idx, BLOCK)
        kaa, kab = _halves(ka, B=BLOCK // 2)
        kba, kbb = _halves(kb, B=BLOCK // 2)
        iaa, iab = _halves(ia, B=BLOCK // 2)
        iba, ibb = _halves(ib, B=BLOCK // 2)
        b_cnt = (_piece_count(kaa, thr, T) + _piece_count(kab, thr, T)
                 + _piece_count(kba, thr, T) + _piece_count(kbb, thr, T))
        o_l = _slots(n_done, b_cnt, p_cnt, ATOMIC)
        o_l = _piece_store(kaa, iaa, thr, o_l, p_list, CAP, T)
        o_l = _piece_store(kab, iab, thr, o_l, p_list, CAP, T)
        o_l = _piece_store(kba, iba, thr, o_l, p_list, CAP, T)
        _piece_store(kbb, ibb, thr, o_l, p_list, CAP, T)
    return n_done + tl.sum(b_cnt)


@triton.jit
def _above(b_bits, top, KEYS: tl.constexpr, BLOCK: tl.constexpr, T: tl.constexpr):
    """Per thread, how many of its entries of a block have key > top."""
    b_key = b_bits
    if KEYS:
        b_key = _float_key(b_bits)
    return tl.sum(tl.sum(tl.reshape((b_key > top).to(tl.int32), [BLOCK // (4 * T), T, 4]), 2), 0)


@triton.jit
def _collect_pass(p_base, lo, hi, ks, thr, top, p_list, p_cnt, KEYS: tl.constexpr,
                  ATOMIC: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
                  T: tl.constexpr, STAGES: tl.constexpr):
    """Pass 2 over [lo, hi) of a row starting at ks: every entry with key >= thr (>
    INT32_MIN, so never a masked lane) goes to p_list as (key << 32 | index - ks), at most CAP
    of them. With ATOMIC, other programs fill the same list: the slots are reserved in the
    low half of the int64 counter at p_cnt, and the entries with key > top are counted in its
    high half. Runs from the end, where pass 1 finished, so the first blocks it reads are
    the likeliest to be still in L2."""
    a, n_full, t = _main_range(lo, hi, BLOCK)
    n_done = lo * 0
    acc = tl.zeros([T], tl.int32)
    if t < hi:
        o_x, b_bits = _masked_bits(p_base, t, t, hi, BLOCK)
        n_done = _collect_block(o_x, b_bits, ks, thr, n_done, p_list, p_cnt, KEYS, ATOMIC, CAP,
                                BLOCK, T)
        if ATOMIC:
            acc += _above(b_bits, top, KEYS, BLOCK, T)
    o_b = tl.arange(0, BLOCK)
    for i in tl.range(0, n_full, num_stages=STAGES):
        o_x = (a + (n_full - 1 - i) * BLOCK) + o_b
        b_bits = tl.load(p_base + o_x).to(tl.int32, bitcast=True)
        n_done = _collect_block(o_x, b_bits, ks, thr, n_done, p_list, p_cnt, KEYS, ATOMIC, CAP,
                                BLOCK, T)
        if ATOMIC:
            acc += _above(b_bits, top, KEYS, BLOCK, T)
    if lo < a:
        o_x, b_bits = _masked_bits(p_base, a - 16, lo, tl.minimum(a, hi), BLOCK)
        _collect_block(o_x, b_bits, ks, thr, n_done, p_list, p_cnt, KEYS, ATOMIC, CAP, BLOCK,
                       T)
        if ATOMIC:
            acc += _above(b_bits, top, KEYS, BLOCK, T)
    if ATOMIC:
        tl.atomic_add(p_cnt, tl.sum(acc).to(tl.int64) << 32, sem="relaxed")


@triton.jit
def _ties_pass(p_base, ks, ke, t, n_gt, p_dst, K: tl.constexpr, BLOCK: tl.constexpr):
    """The n_gt entries with key > t go to p_dst[0..n_gt) and the first K - n_gt entries with
    key == t, in index order, to p_dst[n_gt..K); stops once both are complete."""
    need = K - n_gt
    n_a = n_gt * 0
    n_e = n_gt * 0
    start = ks // 16 * 16
    while (start < ke) & ((n_a < n_gt) | (n_e < need)):
        o_x, b_key = _masked_bits(p_base, start, ks, ke, BLOCK)
        b_key = _float_key(b_key)
        b_gt = b_key > t
        b_eq = b_key == t
        # Both output positions from one scan: BLOCK < 2**15, so the halves never carry.
        b_code = b_gt.to(tl.int32) + (b_eq.to(tl.int32) << 16)
        b_csum = tl.cumsum(b_code, 0)
        o_e = n_e + (b_csum >> 16) - 1
        tl.store(p_dst + n_a + (b_csum & 0xFFFF) - 1, o_x - ks, mask=b_gt)
        tl.store(p_dst + n_gt + o_e, o_x - ks, mask=b_eq & (o_e < need))
        b_tot = tl.sum(b_code)
        n_a += b_tot & 0xFFFF
        n_e += b_tot >> 16
        start += BLOCK


@triton.jit
def _sample_window(p_row, length, row, K: tl.constexpr, RUNS: tl.constexpr,
                   RUN: tl.constexpr, Z: tl.constexpr):
    """Key range [lo, hi] (int64) that a jittered sample of RUNS runs of RUN entries says holds
    the row's k-th largest: the sample's keys of rank r +/- Z sqrt(r), r = k S / length, found
    by three rounds of ROUND_BINS-bin histograms, each over the previous one's bracket."""
    S: tl.constexpr = RUNS * RUN
    seg = length // RUNS
    o_run = tl.arange(0, RUNS)
    b_h = (o_run + row * RUNS).to(tl.uint32) * 1103515245 + 12345
    b_h = b_h ^ (b_h >> 16)
    b_jitter = (b_h % (seg - RUN + 1).to(tl.uint32)).to(tl.int32)
    o_s = (o_run * seg + b_jitter)[:, None] + tl.arange(0, RUN)[None, :]
    b_key = tl.reshape(_float_key(tl.load(p_row + o_s).to(tl.int32, bitcast=True)), [S])
    r = (K * S) / length.to(tl.float32)
    spread = Z * tl.sqrt(r)
    need_a = tl.maximum(tl.floor(r - spread), 0.0).to(tl.int32)
    need_b = tl.maximum(tl.minimum(tl.ceil(r + spread), S), 1.0).to(tl.int32)
    lo = tl.min(b_key).to(tl.int64)
    hi = tl.max(b_key).to(tl.int64)
    for _ in tl.static_range(3):
        sh = _shift_for(hi - lo, BOUND=ROUND_BINS)
        b_bin = _bin(b_key, lo.to(tl.int32), sh, NB=ROUND_BINS).to(tl.int32)
        c = tl.cumsum(tl.histogram(b_bin, ROUND_BINS), 0, reverse=True)
        pk = tl.sum((c >= need_a).to(tl.int32) + ((c >= need_b).to(tl.int32) << 16))
        ja = (pk & 0xFFFF) - 1
        jb = (pk >> 16) - 1
        new_hi = tl.where(ja == ROUND_BINS - 1, hi, lo + ((ja + 1).to(tl.int64) << sh) - 1)
        lo = tl.minimum(lo + (jb.to(tl.int64) << sh), new_hi)
        hi = new_hi
    return lo, hi


@triton.jit
def _narrow(p_list, n_c, lo, hi, need, n_live, t, BY_INDEX: tl.constexpr,
            CHUNK: tl.constexpr):
    """Narrow the int64 range [lo, hi] down to the need-th largest value of the entries of
    p_list[0..n_c) that lie in it, ROUND_BINS bins a round. The values are the keys or, with
    BY_INDEX, minus the index of the entries whose key is t. Returns that value, and, of the
    entries holding it, how many belong to the top (need) and how many there are (n_live)."""
    j = tl.arange(0, ROUND_BINS)
    # Each round cuts [lo, hi] at least 16-fold: 8 rounds cover any 32-bit range.
    for _ in tl.range(0, 8, disable_licm=True):
        if lo < hi:
            sh = _shift_for(hi - lo, BOUND=ROUND_BINS)
            h = tl.zeros([ROUND_BINS], tl.int32)
            for c0 in range(0, n_c, CHUNK):
                o_c = c0 + tl.arange(0, CHUNK)
                m_c = o_c < n_c
                b_pair = tl.load(p_list + o_c, mask=m_c, other=0)
                if BY_INDEX:
                    b_v = -b_pair.to(tl.int32)
                    m_c = m_c & ((b_pair >> 32).to(tl.int32) == t)
                else:
                    b_v = (b_pair >> 32).to(tl.int32)
                m_c = m_c & (b_v >= lo) & (b_v <= hi)
                b_bin = _bin(b_v, lo.to(tl.int32), sh, NB=ROUND_BINS).to(tl.int32)
                h += tl.histogram(b_bin, ROUND_BINS, mask=m_c)
            c = tl.cumsum(h, 0, reverse=True)
            jb = tl.sum((c >= need).to(tl.int32)) - 1
            pk = tl.sum(tl.where(j == jb, (c.to(tl.int64) << 32) | h.to(tl.int64), 0))
            n_live = (pk & 0xFFFFFFFF).to(tl.int32)
            need -= (pk >> 32).to(tl.int32) - n_live
            lo = lo + (jb.to(tl.int64) << sh)
            hi = tl.minimum(lo + (tl.full([], 1, tl.int64) << sh) - 1, hi)
    return lo, need, n_live


@triton.jit
def _select(p_row, p_list, p_dst, length, n_list, n_above, lo_bin, hi_bin, direct,
            K: tl.constexpr, CHUNK: tl.constexpr):
    """Write the top K of a list to p_dst. The list is the program's p_list[0..n_list) of
    (key, index) pairs in any order, or with ``direct`` the row itself (p_row[0..n_list)).
    Its n_above entries with key > hi_bin all belong to the top K, those in [lo_bin, hi_bin]
    are candidates, and those below lo_bin are not."""
    tl.debug_barrier()  # the list was written by other lanes
    # A: entries above the threshold bin to the output, candidates to the list's front (in
    # place: none is written past the end of the chunk it was read from, and the barrier in
    # the loop keeps every lane's read of a chunk before any write into it).
    n_a = n_list * 0
    n_c = n_list * 0
    c_min = n_list * 0 + INT32_MAX
    c_max = n_list * 0 + INT32_MIN
    for c0 in range(0, n_list, CHUNK):
        o_c = c0 + tl.arange(0, CHUNK)
        m_c = o_c < n_list
        if direct:
            b_key = _float_key(tl.load(p_row + o_c, mask=m_c, other=0.0)
                               .to(tl.int32, bitcast=True))
            b_idx = o_c
        else:
            b_pair = tl.load(p_list + o_c, mask=m_c, other=0)
            b_key = (b_pair >> 32).to(tl.int32)
            b_idx = b_pair.to(tl.int32)
        b_above = m_c & (b_key > hi_bin)
        b_cand = m_c & (b_key <= hi_bin) & (b_key >= lo_bin)
        # Both positions from one scan: CHUNK < 2**15, so the halves never carry.
        b_code = b_above.to(tl.int32) + (b_cand.to(tl.int32) << 16)
        b_csum = tl.cumsum(b_code, 0)
        tl.debug_barrier()
        tl.store(p_dst + n_a + (b_csum & 0xFFFF) - 1, b_idx, mask=b_above)
        tl.store(p_list + n_c + (b_csum >> 16) - 1, _pair(b_key, b_idx), mask=b_cand)
        b_tot = tl.sum(b_code)
        n_a += b_tot & 0xFFFF
        n_c += b_tot >> 16
        c_min = tl.minimum(c_min, tl.min(tl.where(b_cand, b_key, INT32_MAX)))
        c_max = tl.maximum(c_max, tl.max(tl.where(b_cand, b_key, INT32_MIN)))
    tl.debug_barrier()
    # B: the threshold key t among the candidates, how many of its ties the top K takes
    # (need) and how many there are (n_tie); if not all, the index cut that takes the lowest.
    t, need, n_tie = _narrow(p_list, n_c, c_min.to(tl.int64), c_max.to(tl.int64),
                             K - n_above, n_c, 0, BY_INDEX=False, CHUNK=CHUNK)
    t = t.to(tl.int32)
    i_cut = n_list * 0 + INT32_MAX
    if n_tie > need:
        m_i, _, _ = _narrow(p_list, n_c, (1 - length).to(tl.int64), (length * 0).to(tl.int64),
                            need, n_tie, t, BY_INDEX=True, CHUNK=CHUNK)
        i_cut = -m_i.to(tl.int32)
    # C: candidates above t and the ties at t up to the index cut.
    n_w = n_list * 0
    for c0 in range(0, n_c, CHUNK):
        o_c = c0 + tl.arange(0, CHUNK)
        b_pair = tl.load(p_list + o_c, mask=o_c < n_c, other=0)
        b_key = (b_pair >> 32).to(tl.int32)
        b_idx = b_pair.to(tl.int32)
        b_take = (o_c < n_c) & ((b_key > t) | ((b_key == t) & (b_idx <= i_cut)))
        b_csum = tl.cumsum(b_take.to(tl.int32), 0)
        tl.store(p_dst + n_above + n_w + b_csum - 1, b_idx, mask=b_take)
        n_w += tl.sum(b_take.to(tl.int32))
    tl.debug_barrier()  # the next row rewrites the list


@triton.jit
def _threshold_bin(p_base, p_list, ks, ke, length, lo, hi, path, n_list, n_above, j,
                   K: tl.constexpr, CAND: tl.constexpr, BLOCK: tl.constexpr, T: tl.constexpr,
                   STAGES: tl.constexpr, SAMPLED: tl.constexpr):
    """Steps 4 and 7: pass 1, its bins spread over [lo, hi] (the sample's window, then the
    threshold bin), until the threshold bin b* holds at most CAND entries or is a single key.
    Returns b*'s key range (lo, hi), the count of entries at or above it (c_bin) and above it
    (n_above), the passes taken, and path and n_list: PATH_SAMPLED and the list's length
    where the first pass collected b* and everything above it (else as given)."""
    n_pass = length * 0
    c_bin = length * 0
    done = length * 0
    # A pass cuts [lo, hi] at least 3-fold: 22 passes reach a single key from any
    # range, so the loop never ends with done == 0.
    for _ in tl.range(0, 32, disable_licm=True):
        if done == 0:
            # Spread the pass's inner bins over [lo, hi]: bin 1 starts at lo and bin
            # PASS_BINS-1 (open above) past hi.
            shift = _shift_for(hi - lo, BOUND=PASS_BINS - 2)
            base = tl.maximum(lo - (tl.full([], 1, tl.int64) << shift), INT32_MIN)
            # the first pass also collects bins 1 and up (entries >= thr)
            thr = (base + (tl.full([], 1, tl.int64) << shift)).to(tl.int32)
            base = base.to(tl.int32)
            n_col = length * 0 + INT32_MAX
            if SAMPLED & (n_pass == 0):
                h, n_col = _pass_1(p_base, ks, ke, base, shift, thr, p_list, COLLECT=True,
                                   CAP=CAND, BLOCK=BLOCK, T=T, STAGES=STAGES)
            else:
                h, _ = _pass_1(p_base, ks, ke, base, shift, thr, p_list, COLLECT=False,
                               CAP=CAND, BLOCK=BLOCK, T=T, STAGES=STAGES)
            h = tl.where(j == 0, h - (tl.sum(h) - length), h)  # masked lanes: bin 0
            c = tl.cumsum(h, 0, reverse=True)
            b = tl.sum((c >= K).to(tl.int32)) - 1
            pk = tl.sum(tl.where(j == b, (c.to(tl.int64) << 32) | h.to(tl.int64), 0))
            c_bin = (pk >> 32).to(tl.int32)
            n_above = c_bin - (pk & 0xFFFFFFFF).to(tl.int32)
            # No valid key is INT32_MIN (bits -1 are a NaN), so INT32_MIN + 1 bounds
            # them all from below and keeps the masked lanes out of pass 2.
            lo = tl.where(b == 0, INT32_MIN + 1, base + (b.to(tl.int64) << shift))
            hi = tl.where(b == PASS_BINS - 1, INT32_MAX,
                          tl.minimum(base + ((b + 1).to(tl.int64) << shift) - 1,
                                     INT32_MAX))
            n_pass += 1
            done = ((c_bin <= CAND) | (lo == hi)).to(tl.int32)
            if (b > 0) & (n_col <= CAND):
                # The threshold bin lies in what the pass collected: no pass 2.
                path = length * 0 + _SAMPLED
                n_list = n_col
                done = length * 0 + 1
    return lo, hi, c_bin, n_above, n_pass, path, n_list


@triton.jit
def _pass_1(p_base, ks, ke, base, shift, thr, p_list, COLLECT: tl.constexpr,
            CAP: tl.constexpr, BLOCK: tl.constexpr, T: tl.constexpr, STAGES: tl.constexpr):
    """_hist_pass on the raw bits where every bin lies at or above zero (the same order as
    the keys there, without the key transform), else on the keys."""
    if base >= 0:
        h, n_col = _hist_pass(p_base, ks, ke, base, shift, thr, p_list, KEYS=False,
                              COLLECT=COLLECT, CAP=CAP, BLOCK=BLOCK, T=T, STAGES=STAGES)
    else:
        h, n_col = _hist_pass(p_base, ks, ke, base, shift, thr, p_list, KEYS=True,
                              COLLECT=COLLECT, CAP=CAP, BLOCK=BLOCK, T=T, STAGES=STAGES)
    return h, n_col


@triton.jit
def _pass_2(p_base, lo, hi, ks, thr, top, p_list, p_cnt, ATOMIC: tl.constexpr,
            CAP: tl.constexpr, BLOCK: tl.constexpr, T: tl.constexpr, STAGES: tl.constexpr):
    """_collect_pass on the raw bits where thr >= 0 (as in _pass_1), else on the keys."""
    if thr >= 0:
        _collect_pass(p_base, lo, hi, ks, thr, top, p_list, p_cnt, KEYS=False, ATOMIC=ATOMIC,
                      CAP=CAP, BLOCK=BLOCK, T=T, STAGES=STAGES)
    else:
        _collect_pass(p_base, lo, hi, ks, thr, top, p_list, p_cnt, KEYS=True, ATOMIC=ATOMIC,
                      CAP=CAP, BLOCK=BLOCK, T=T, STAGES=STAGES)


@triton.jit
def _one_row(p_base, p_list, p_dst, ks, ke, row, K: tl.constexpr, BLOCK: tl.constexpr,
             T: tl.constexpr, BLOCK2: tl.constexpr, T2: tl.constexpr, CAND: tl.constexpr,
             CHUNK: tl.constexpr, RUNS: tl.constexpr, RUN: tl.constexpr, Z: tl.constexpr,
             STAGES: tl.constexpr, SAMPLED: tl.constexpr):
    """Steps 1-7 for one row [ks, ke) of p_base, with p_list (CAND pairs) as its list; returns
    the row's path."""
    j = tl.arange(0, PASS_BINS)
    length = tl.maximum(ke - ks, 0)
    p_row = p_base + ks
    path = length * 0
    # what the selection needs, set by the direct and the two-pass paths
    do_select = length < 0
    direct = length < 0
    n_list = length * 0
    n_above = length * 0
    lo_bin = length * 0 + INT32_MIN
    hi_bin = length * 0 + INT32_MAX
    if length <= K:
        for c0 in range(0, K, CHUNK):
            o_k = c0 + tl.arange(0, CHUNK)
            tl.store(p_dst + o_k, tl.where(o_k < length, o_k, -1), mask=o_k < K)
    elif length <= tl.minimum(CAND, 2 * RUNS * RUN):
        # Too short for a useful sample: select from the row itself. (Longer rows that
        # would fit the list still take the passes: a pass over a short row costs less
        # than narrowing all of it in the selection's rounds.)
        do_select = length > 0
        direct = length > 0
        n_list = length
        path = length * 0 + _DIRECT
    else:
        lo, hi = _sample_window(p_row, length, row, K, RUNS, RUN, Z)
        lo, hi, c_bin, n_above, n_pass, path, n_list = _threshold_bin(
            p_base, p_list, ks, ke, length, lo, hi, path, n_list, n_above, j, K=K,
            CAND=CAND, BLOCK=BLOCK, T=T, STAGES=STAGES, SAMPLED=SAMPLED)
        if path == _SAMPLED:
            do_select = length > 0
            lo_bin = lo.to(tl.int32)
            hi_bin = hi.to(tl.int32)
        elif c_bin <= CAND:
            _pass_2(p_base, ks, ke, ks, lo.to(tl.int32), INT32_MAX, p_list, p_list, ATOMIC=False,
                    CAP=CAND, BLOCK=BLOCK2, T=T2, STAGES=STAGES)
            do_select = length > 0
            n_list = c_bin
            hi_bin = hi.to(tl.int32)
            path = length * 0 + tl.where(n_pass == 1, _RADIX, _REFINED)
        else:
            _ties_pass(p_base, ks, ke, lo.to(tl.int32), n_above, p_dst, K=K, BLOCK=BLOCK2)
            path = length * 0 + _TIES
    if do_select:
        _select(p_row, p_list, p_dst, length, n_list, n_above, lo_bin, hi_bin, direct, K=K,
                CHUNK=CHUNK)
    return path


@triton.jit
def _topk_kernel(p_x, p_ks, p_ke, p_out, p_scratch, p_path, M, N, stride_xm, stride_om,
                 K: tl.constexpr, BLOCK: tl.constexpr, T: tl.constexpr,
                 BLOCK2: tl.constexpr, T2: tl.constexpr, CAND: tl.constexpr,
                 CHUNK: tl.constexpr, RUNS: tl.constexpr, RUN: tl.constexpr,
                 Z: tl.constexpr, STAGES: tl.constexpr, SAMPLED: tl.constexpr,
                 WITH_PATH: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    p_list = p_scratch + pid.to(tl.int64) * CAND  # int64 pairs
    # No hoisting out of the row loop (nor out of the refinement loop and the selection
    # rounds): values kept live across it would cost every phase registers.
    for row in tl.range(pid, M, nprog, disable_licm=True):
        ks = tl.maximum(tl.load(p_ks + row), 0)
        ke = tl.minimum(tl.load(p_ke + row), N)
        row_64 = tl.cast(row, tl.int64)
        path = _one_row(p_x + row_64 * stride_xm, p_list, p_out + row_64 * stride_om, ks, ke,
                        row, K=K, BLOCK=BLOCK, T=T, BLOCK2=BLOCK2, T2=T2, CAND=CAND,
                        CHUNK=CHUNK, RUNS=RUNS, RUN=RUN, Z=Z, STAGES=STAGES, SAMPLED=SAMPLED)
        if WITH_PATH:
            tl.store(p_path + row, path.to(tl.int8))


@triton.jit
def _stream_setup_kernel(p_x, p_ks, p_ke, p_lo, p_hi, p_done, p_cnt, N, stride_xm,
                         K: tl.constexpr, CAND: tl.constexpr, RUNS: tl.constexpr,
                         RUN: tl.constexpr, Z: tl.constexpr):
    """Stream step 1, a program a row: the sample's window [lo, hi] (the row's segments
    collect every key >= lo and count those > hi), and the row's counters set to 0."""
    row = tl.program_id(0)
    ks = tl.maximum(tl.load(p_ks + row), 0)
    ke = tl.minimum(tl.load(p_ke + row), N)
    length = tl.maximum(ke - ks, 0)
    lo = length * 0 + INT32_MIN
    hi = length * 0 + INT32_MAX
    if length > tl.minimum(CAND, 2 * RUNS * RUN):
        w_lo, w_hi = _sample_window(p_x + row.to(tl.int64) * stride_xm + ks, length, row, K,
                                    RUNS, RUN, Z)
        lo = w_lo.to(tl.int32)
        hi = w_hi.to(tl.int32)
    tl.store(p_lo + row, lo)
    tl.store(p_hi + row, hi)
    tl.store(p_done + row, length * 0)
    tl.store(p_cnt + row, (length * 0).to(tl.int64))


@triton.jit
def _stream_kernel(p_x, p_ks, p_ke, p_out, p_lo, p_hi, p_done, p_cnt, p_lists, p_path, N, SEG,
                   n_seg, stride_xm, stride_om, K: tl.constexpr, BLOCK: tl.constexpr,
                   T: tl.constexpr, BLOCK2: tl.constexpr, T2: tl.constexpr,
                   CAND: tl.constexpr, CHUNK: tl.constexpr, RUNS: tl.constexpr,
                   RUN: tl.constexpr, Z: tl.constexpr, STAGES: tl.constexpr,
                   SAMPLED: tl.constexpr, WITH_PATH: tl.constexpr):
    """Stream step 2, n_seg programs a row, each over one SEG-entry segment (16-aligned from
    the row's start rounded down): every entry at or above the row's floor goes to the row's
    list, in slots reserved by one atomic a block, and those above the window are counted.
    The program that finishes a row's last segment selects from its list (those above the
    window go straight to the output), or, where the window does not hold the k-th largest or
    the list overflowed, runs the row's other paths (_one_row). Rows too short for a sample
    are _one_row's alone."""
    pid = tl.program_id(0)
    row = pid // n_seg
    seg = pid % n_seg
    ks = tl.maximum(tl.load(p_ks + row), 0)
    ke = tl.minimum(tl.load(p_ke + row), N)
    length = tl.maximum(ke - ks, 0)
    row_64 = tl.cast(row, tl.int64)
    p_base = p_x + row_64 * stride_xm
    p_list = p_lists + row_64 * CAND
    p_dst = p_out + row_64 * stride_om
    a0 = ks // 16 * 16
    n_seg_row = tl.cdiv(ke - a0, SEG)
    path = length * 0 - 1
    if length <= tl.minimum(CAND, 2 * RUNS * RUN):
        if seg == 0:
            path = _one_row(p_base, p_list, p_dst, ks, ke, row, K=K, BLOCK=BLOCK, T=T,
                            BLOCK2=BLOCK2, T2=T2, CAND=CAND, CHUNK=CHUNK, RUNS=RUNS, RUN=RUN,
                            Z=Z, STAGES=STAGES, SAMPLED=SAMPLED)
    elif seg < n_seg_row:
        lo = tl.load(p_lo + row)
        hi = tl.load(p_hi + row)
        _pass_2(p_base, tl.maximum(ks, a0 + seg * SEG), tl.minimum(ke, a0 + (seg + 1) * SEG),
                ks, lo, hi, p_list, p_cnt + row, ATOMIC=True, CAP=CAND, BLOCK=BLOCK, T=T,
                STAGES=STAGES)
        # Every lane's list writes before the count that tells the last program it may
        # read them (a release at the device's scope, after the block's barrier).
        tl.debug_barrier()
        ticket = tl.atomic_add(p_done + row, 1, sem="acq_rel", scope="gpu")
        if ticket == n_seg_row - 1:
            packed = tl.atomic_add(p_cnt + row, 0, sem="acquire", scope="gpu")
            n = (packed & 0xFFFFFFFF).to(tl.int32)
            n_above = (packed >> 32).to(tl.int32)
            if (n_above < K) & (n >= K) & (n <= CAND):
                _select(p_base + ks, p_list, p_dst, length, n, n_above, lo, hi, False, K=K,
                        CHUNK=CHUNK)
                path = length * 0 + _STREAM
            else:
                path = _one_row(p_base, p_list, p_dst, ks, ke, row, K=K, BLOCK=BLOCK, T=T,
                                BLOCK2=BLOCK2, T2=T2, CAND=CAND, CHUNK=CHUNK, RUNS=RUNS,
                                RUN=RUN, Z=Z, STAGES=STAGES, SAMPLED=SAMPLED)
    if WITH_PATH:
        if path >= 0:
            tl.store(p_path + row, path.to(tl.int8))


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TopkConfig:
    """``block``: entries per step of pass 1; ``collect_block``: entries per step of pass 2;
    ``cand``: capacity of a program's list (the entries at or above the threshold bin: more
    than k); ``chunk``: list entries per step of the selection; ``runs`` x ``run``: the
    sample (rows up to twice as long skip the passes); ``z``: the window's half-width in
    standard deviations of the sample rank; ``stages``: software-pipeline depth of the row
    passes' loads (cp.async through shared memory); ``num_warps``; ``programs_per_sm``:
    persistent programs per SM, which also caps the registers a thread may use so that they
    all fit; ``sampled``: pass 1 also collects what lies above the sample's window, so that
    most rows need no pass 2; ``stream``: the streaming layout instead of persistent
    programs (``top_k_per_row``'s docstring); ``segment``: its entries a program (a multiple
    of ``block``; 0: chosen from the rows and the GPU's SMs).

    The defaults are the fastest of the benchmark's A/B runs over [4096, 65536] normal
    logits at k = 2048 (docs/indexer-kernels.md): a 1024-entry sample's longer lists cost the
    selection more than the larger sample costs, and one read beats two on full rows. On
    shorter rows (causal) the list's share of the work grows, and two reads can be faster."""
    block: int = 2048
    collect_block: int = 1024
    cand: int = 4096
    chunk: int = 512
    runs: int = 256
    run: int = 8
    z: float = 3.0
    stages: int = 4
    num_warps: int = 4
    programs_per_sm: int = 4
    sampled: bool = True
    stream: bool = False
    segment: int = 0

    def validate(self, k: int) -> None:
        for name in ("block", "collect_block", "cand", "chunk", "runs", "run", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"TopkConfig.{name} must be a power of two, got {v}")
        for name in ("block", "collect_block"):
            v = getattr(self, name)
            if not 16 <= v < 2**15:
                raise ValueError(f"TopkConfig.{name} must be in [16, 32768), got {v} "
                                 "(16-entry aligned passes, 16-bit packed counts)")
        if self.block // (4 * _threads(self.block, self)) > 31:
            raise ValueError(f"TopkConfig.block ({self.block}) must be at most 124 entries a "
                             f"thread ({124 * 32 * self.num_warps} at {self.num_warps} warps): "
                             "a block's bin counts are bytes")
        if ((self.sampled or self.stream)
                and self.block // (4 * _threads(self.block, self)) not in (1, 2, 4)):
            raise ValueError(f"TopkConfig.block ({self.block}) must be 4, 8 or 16 entries a "
                             f"thread ({128 * self.num_warps}, {256 * self.num_warps} or "
                             f"{512 * self.num_warps} at {self.num_warps} warps) with "
                             "sampled=True or stream=True: its blocks then also collect")
        if self.segment < 0 or self.segment % self.block:
            raise ValueError(f"TopkConfig.segment ({self.segment}) must be 0 or a positive "
                             f"multiple of block ({self.block})")
        if self.collect_block // (4 * _threads(self.collect_block, self)) not in (1, 2, 4):
            raise ValueError(f"TopkConfig.collect_block ({self.collect_block}) must be 4, 8 or "
                             f"16 entries a thread ({128 * self.num_warps}, "
                             f"{256 * self.num_warps} or {512 * self.num_warps} at "
                             f"{self.num_warps} warps)")
        if not 32 <= self.chunk < 2**15:
            raise ValueError(f"TopkConfig.chunk must be in [32, 32768), got {self.chunk}")
        if self.cand <= k:
            raise ValueError(f"TopkConfig.cand ({self.cand}) must exceed k ({k})")
        if self.runs * self.run > self.cand:
            raise ValueError(f"the sample (runs * run = {self.runs * self.run}) must fit in "
                             f"cand ({self.cand})")
        if self.run > 2**15 // self.runs:
            raise ValueError("the sample (runs * run) must be below 32768")
        if not self.z >= 0:
            raise ValueError(f"TopkConfig.z must be >= 0, got {self.z}")
        if self.stages < 1:
            raise ValueError(f"TopkConfig.stages must be >= 1, got {self.stages}")
        if self.programs_per_sm < 1:
            raise ValueError(f"TopkConfig.programs_per_sm must be >= 1, got "
                             f"{self.programs_per_sm}")


def _threads(block: int, cfg: TopkConfig) -> int:
    # The T of a block's [R, T, 4] view: the threads of a program, unless the block has fewer
    # vectors of 4 (the interpreter's small blocks).
    return min(32 * cfg.num_warps, block // 4)


def max_registers(cfg: TopkConfig) -> int:
    """Registers a thread may use so that ``programs_per_sm`` programs fit in an SM's 65,536
    (allocated in multiples of 8, at most 255)."""
    return min(255, 65536 // (32 * cfg.num_warps * cfg.programs_per_sm) // 8 * 8)


@functools.cache  # called per prefill; the config is frozen, so one shared object is safe
def default_config(k: int, device: str = "cuda",
                   capability: tuple[int, int] | None = None) -> TopkConfig:
    """The config a call at k uses when none is given, on a device of ``capability`` (default:
    the current CUDA device's; without one, the generic family's, indexer/_device.py)."""
    kp = triton.next_power_of_2(max(k, 1))
    if device == "cpu":
        # Interpreter: small blocks so that short test rows take every path.
        return TopkConfig(block=64, collect_block=32, cand=max(128, 4 * kp), chunk=32, runs=8,
                          run=4, z=3.0, stages=1, num_warps=4, programs_per_sm=1)
    base = TopkConfig(cand=max(4096, 2 * kp))
    fam = (family_of(capability) if capability is not None
           else family() if torch.cuda.is_available() else "generic")
    if fam in ("sm_120", "generic"):
        # An SM of 100 KiB of shared memory (sm_120, sm_121, Ada) holds three programs of four
        # pipeline stages (24 KiB and 16 bytes each, and the 1 KiB a block reserves), four of
        # three; four programs keep the overlap of one's selection with the others' streaming
        # that the defaults were timed with on the H200. Not timed on those GPUs.
        return replace(base, stages=3)
    return base


def sweep_configs(k: int, capability: tuple[int, int] | None = None) -> list[TopkConfig]:
    """Candidates for a GPU sweep (the first is the default, ``capability`` as there);
    tests/indexer (its compiled tests) checks that each compiles for sm_90 with no spills in
    the row passes under its register cap."""
    base = default_config(k, "cuda", capability)
    return [base,
            replace(base, sampled=False),
            replace(base, runs=128),
            replace(base, stages=3 if base.stages != 3 else 4),
            replace(base, programs_per_sm=3),
            replace(base, sampled=False, collect_block=2048),
            replace(base, num_warps=8, programs_per_sm=2, block=4096, collect_block=2048)]


def path_counts(path: torch.Tensor) -> dict[str, int]:
    """Rows per path of a ``return_path`` record, by name."""
    counts = torch.bincount(path.long().cpu(), minlength=len(PATH_NAMES)).tolist()
    return dict(zip(PATH_NAMES, counts))


def _grid_size(m: int, device: torch.device, cfg: TopkConfig) -> int:
    if device.type == "cpu":
        return max(1, min(m, 3))
    return max(1, min(m, sm_count(device) * cfg.programs_per_sm))


@functools.lru_cache(maxsize=64)
def _launch_constants(cfg: TopkConfig, k: int) -> dict:
    # Once per (config, k), not once per call: a prefill calls top_k_per_row for every piece.
    # A config that fails validation raises and is not cached.
    cfg.validate(k)
    return {"K": k, "BLOCK": cfg.block, "T": _threads(cfg.block, cfg),
            "BLOCK2": cfg.collect_block, "T2": _threads(cfg.collect_block, cfg),
            "CAND": cfg.cand, "CHUNK": cfg.chunk, "RUNS": cfg.runs, "RUN": cfg.run, "Z": cfg.z,
            "STAGES": cfg.stages, "SAMPLED": cfg.sampled, "num_warps": cfg.num_warps,
            "maxnreg": max_registers(cfg)}


def _stream_head(m: int) -> int:
    # int32 elements before the lists: the windows' ends and the finished segments (m each,
    # rounded up to 8-byte alignment), then the int64 counters
    return (3 * m + 1) // 2 * 2 + 2 * m


def scratch_elems(m: int, device: torch.device, cfg: TopkConfig) -> int:
    """int32 elements of scratch a call over m rows needs: one list of ``cand`` int64 pairs per
    program, or with ``stream`` per row (and three counters a row)."""
    if cfg.stream:
        return _stream_head(m) + m * cfg.cand * 2
    return _grid_size(m, device, cfg) * cfg.cand * 2


def _segment(m: int, n: int, device: torch.device, cfg: TopkConfig) -> int:
    """Entries a stream program reads: enough programs for four waves of ``programs_per_sm``
    on every SM, but at least two blocks each (the interpreter: two blocks)."""
    if cfg.segment:
        return cfg.segment
    if device.type == "cpu":
        return 2 * cfg.block
    per_row = max(1, 4 * sm_count(device) * cfg.programs_per_sm // max(m, 1))
    return max(2 * cfg.block, triton.cdiv(triton.cdiv(n, per_row), cfg.block) * cfg.block)


def _launch_stream(logits, ks, ke, out, pairs, head, path, consts, cfg, return_path):
    m, n = logits.shape
    seg = _segment(m, n, logits.device, cfg)
    n_seg = triton.cdiv(n + 15, seg)
    lo, hi, done = head[:m], head[m:2 * m], head[2 * m:3 * m]
    cnt = head[(3 * m + 1) // 2 * 2:].view(torch.int64)
    _stream_setup_kernel[(m,)](
        logits, ks, ke, lo, hi, done, cnt, n, logits.stride(0), K=consts["K"], CAND=cfg.cand,
        RUNS=cfg.runs, RUN=cfg.run, Z=cfg.z, num_warps=cfg.num_warps, **LAUNCH_OPTIONS)
    _stream_kernel[(m * n_seg,)](
        logits, ks, ke, out, lo, hi, done, cnt, pairs, path, n, seg, n_seg, logits.stride(0),
        out.stride(0), WITH_PATH=return_path, **consts, **LAUNCH_OPTIONS)


def top_k_per_row(logits: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, k: int,
                  out: torch.Tensor | None = None, *, scratch: torch.Tensor | None = None,
                  config: TopkConfig | None = None, return_path: bool = False):
    """Top-k indices per row of ``logits[i, ks[i]:ke[i]]``, relative to ``ks[i]``.

    Shapes: logits float32 ``[M, N]`` (unit column stride, any row stride); ks, ke int32
    ``[M]``, clamped to ``[0, N]``; ``out`` int32 ``[M, k]`` with unit column stride (allocated
    if not given); ``scratch`` int32, 8-byte aligned, with at least
    ``scratch_elems(M, device, config)`` elements (allocated if not given; its size does not
    depend on N). Rows with fewer than k entries are padded with ``-1``. Entries inside a
    row's range must not be NaN.

    With ``config.stream`` the row is read by many short-lived programs instead of one
    persistent one: a first kernel takes each row's sample (step 3) and keeps the floor of its
    window; the second reads each row once in ``segment``-entry pieces, one program each, and
    collects every entry at or above the floor into the row's own list (its slots reserved by
    one atomic a block); the program that finishes a row's last piece selects (step 6) from
    the list, or, where it holds fewer than k entries or overflowed ``cand``, takes the row
    through steps 4-7. No step of a row waits on a histogram across the row, and one row's
    selection overlaps the other programs' reads. Its scratch is a list per row, not per
    program.

    Returns ``out``, or ``(out, path)`` with ``return_path``: int8 ``[M]``, one of the
    ``PATH_*`` values per row (``PATH_NAMES``).
    """
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32 [M, N], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    m, n = logits.shape
    if n > 0 and m > 0 and logits.stride(1) != 1:
        raise ValueError("logits must have unit column stride")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    for name, t in (("ks", ks), ("ke", ke)):
        if t.shape != (m,) or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int32 [{m}], got {t.dtype} "
                             f"{tuple(t.shape)}")
    cfg = config or default_config(k, logits.device.type,
                                   capability(logits.device) if logits.is_cuda else None)
    consts = _launch_constants(cfg, k)
    if out is None:
        out = torch.empty((m, k), dtype=torch.int32, device=logits.device)
    if out.shape != (m, k) or out.dtype != torch.int32 or (m > 0 and out.stride(1) != 1):
        raise ValueError(f"out must be int32 [{m}, {k}] with unit column stride")
    path = torch.empty(m if return_path else 1, dtype=torch.int8, device=logits.device)
    if m == 0:
        return (out, path) if return_path else out
    need = scratch_elems(m, logits.device, cfg)
    if scratch is None:
        scratch = torch.empty(need, dtype=torch.int32, device=logits.device)
    elif (scratch.dtype != torch.int32 or scratch.numel() < need or not scratch.is_contiguous()
          or scratch.data_ptr() % 8):
        raise ValueError(f"scratch must be contiguous, 8-byte aligned int32 with at least "
                         f"{need} elements")
    if cfg.stream:
        head = _stream_head(m)
        pairs = scratch.narrow(0, head, need - head).view(torch.int64)
        _launch_stream(logits, ks, ke, out, pairs, scratch.narrow(0, 0, head), path, consts, cfg,
                       return_path)
        return (out, path) if return_path else out
    pairs = scratch.narrow(0, 0, need).view(torch.int64)
    _topk_kernel[(_grid_size(m, logits.device, cfg),)](
        logits, ks, ke, out, pairs, path, m, n, logits.stride(0), out.stride(0),
        WITH_PATH=return_path, **consts, **LAUNCH_OPTIONS,
    )
    return (out, path) if return_path else out
