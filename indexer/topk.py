"""Per-row top-k over float32 logits in Triton: sample-bracketed radix select.

For row i the kernel returns the indices (relative to ``ks[i]``) of the ``k`` largest entries
of ``logits[i, ks[i]:ke[i]]``, ``-1`` padding rows shorter than k. Order within a row is not by
value: entries above the threshold come first in index order, then the threshold's own
entries; ties at the threshold go to the lowest indices.

Why not the radix select of vLLM's ``top_k_per_row`` or tilelang's top-k as written: they build
a 2048-bin histogram with shared-memory atomics in a single pass, and Triton has neither
shared-memory atomics nor a cheap wide histogram (``tl.histogram`` lowers to one warp ballot
per key bit plus one popcount per owned bin, so its cost grows with the bin count). The
selection is the same radix idea — float keys mapped to order-preserving integers, a threshold
key found digit by digit, then one compaction — with the coarse digits replaced by a sample:

1. ``L = ke - ks <= k``: write ``0..L-1`` and ``-1``s.
2. ``L <= CAND``: the whole row is the candidate set (step 4).
3. Otherwise read ``RUNS`` runs of ``RUN`` consecutive entries at jittered, evenly spread
   positions (a sample of ``S = RUNS * RUN``). Where the k-th largest of the row should fall in
   the sample (rank ``r = k S / L``), take the sample keys at ranks ``r -/+ Z sqrt(r)`` as a
   bracket ``[t_lo, t_hi]``. One pass over the row (the only full read; it streams from HBM)
   writes entries above ``t_hi`` straight to the output and compacts the entries inside the
   bracket into a per-program scratch list of at most ``CAND`` indices, both positions coming
   from one prefix sum of a packed two-counter code.
4. If the bracket holds the k-th largest (fewer than k above it, at least k at or above
   ``t_lo``) and the candidates fit, the exact threshold among the candidates is found by
   bisection on the integer keys (each step a compare and a block reduction over registers),
   and the candidates above it, plus the first ties, are appended.
5. If not (a skewed sample, or heavy ties), an exact fallback bisects the key range over the
   whole row (up to 32 passes, from L2) and then runs the same compaction with
   ``t_lo = t_hi = threshold``. It is correct for any input, only slower; ``return_path`` tells
   how often it ran.

With the defaults (S = 4096, Z = 5, CAND = 4096, k = 2048) a 65,536-entry row yields about
1,800 candidates (2 Z sqrt(k L / S) in general, so rows up to ~300,000 entries fit), and a
bracket miss has a probability of order 1e-6 for independent values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["TopkConfig", "top_k_per_row", "default_config", "scratch_elems"]

INT32_MIN = tl.constexpr(-(2**31))
INT32_MAX = tl.constexpr(2**31 - 1)

PATH_SHORT, PATH_DIRECT, PATH_SAMPLED, PATH_FALLBACK = 0, 1, 2, 3
"""Values of the per-row path record: row of at most k entries; whole row as candidates;
sample bracket held; exact fallback."""


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _float_key(b_x):
    # float32 -> int32 whose signed order is the float order (-0.0 just below +0.0):
    # negative floats have their magnitude bits flipped.
    b_bits = b_x.to(tl.int32, bitcast=True)
    return b_bits ^ ((b_bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _kth_key(b_key, b_valid, need, lo, hi):
    """Largest t in [lo, hi] with #(valid & key >= t) >= need; needs #(key >= lo) >= need."""
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        cnt = tl.sum((b_valid & (b_key >= mid.to(tl.int32))).to(tl.int32))
        ok = cnt >= need
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _two_kth_keys(b_key, need_a, need_b):
    """The need_a-th and need_b-th largest keys of a sample of fewer than 65,536 keys, found
    by two bisections sharing one reduction per step (counts packed in 16-bit halves)."""
    lo_a = tl.min(b_key).to(tl.int64)
    hi_a = tl.max(b_key).to(tl.int64)
    lo_b = lo_a
    hi_b = hi_a
    while (lo_a < hi_a) | (lo_b < hi_b):
        mid_a = lo_a + (hi_a - lo_a + 1) // 2
        mid_b = lo_b + (hi_b - lo_b + 1) // 2
        b_code = ((b_key >= mid_a.to(tl.int32)).to(tl.int32)
                  + ((b_key >= mid_b.to(tl.int32)).to(tl.int32) << 16))
        cnt = tl.sum(b_code)
        ok_a = (cnt & 0xFFFF) >= need_a
        ok_b = (cnt >> 16) >= need_b
        lo_a = tl.where(ok_a, mid_a, lo_a)
        hi_a = tl.where(ok_a, hi_a, mid_a - 1)
        lo_b = tl.where(ok_b, mid_b, lo_b)
        hi_b = tl.where(ok_b, hi_b, mid_b - 1)
    return lo_a, lo_b


# The row passes index the row from its (aligned) start and begin at ks rounded down to 16
# entries, so every block starts 64-byte aligned; blocks wholly inside [ks, ke) load without a
# mask, which is what lets Triton vectorize them (a runtime mask may change within a vector).

@triton.jit
def _row_block(p_base, start, ks, ke, BLOCK: tl.constexpr):
    o_x = start + tl.arange(0, BLOCK)
    m_x = (o_x >= ks) & (o_x < ke)
    if (start >= ks) & (start + BLOCK <= ke):
        b_x = tl.load(p_base + o_x)
    else:
        b_x = tl.load(p_base + o_x, mask=m_x, other=0.0)
    return o_x, m_x, _float_key(b_x)


@triton.jit
def _count_row(p_base, ks, ke, t, STRICT: tl.constexpr, BLOCK: tl.constexpr):
    """#(key > t) if STRICT else #(key >= t) over row[ks:ke]."""
    cnt = ks * 0
    for start in range(ks // 16 * 16, ke, BLOCK):
        o_x, m_x, b_key = _row_block(p_base, start, ks, ke, BLOCK)
        if STRICT:
            b_hit = b_key > t
        else:
            b_hit = b_key >= t
        cnt += tl.sum((m_x & b_hit).to(tl.int32))
    return cnt


@triton.jit
def _split_pass(p_base, ks, ke, t_hi, t_lo, p_def, def_cap, p_cand, cand_cap,
                BLOCK: tl.constexpr):
    """One pass over the row: indices with key > t_hi go to p_def[0..], indices with
    t_lo <= key <= t_hi to p_cand[0..], both in index order and each cut at its cap. Returns
    the full counts, so a caller can tell whether a cap was hit. Indices are relative to ks."""
    n_def = ks * 0
    n_cand = ks * 0
    for start in range(ks // 16 * 16, ke, BLOCK):
        o_x, m_x, b_key = _row_block(p_base, start, ks, ke, BLOCK)
        b_def = m_x & (b_key > t_hi)
        b_cand = m_x & (b_key >= t_lo) & (b_key <= t_hi)
        # Both output positions from one scan: BLOCK < 2**15, so the halves never carry.
        b_code = b_def.to(tl.int32) + (b_cand.to(tl.int32) << 16)
        b_csum = tl.cumsum(b_code, 0)
        o_def = n_def + (b_csum & 0xFFFF) - 1
        o_cand = n_cand + (b_csum >> 16) - 1
        tl.store(p_def + o_def, o_x - ks, mask=b_def & (o_def < def_cap))
        tl.store(p_cand + o_cand, o_x - ks, mask=b_cand & (o_cand < cand_cap))
        b_tot = tl.sum(b_code)
        n_def += b_tot & 0xFFFF
        n_cand += b_tot >> 16
    return n_def, n_cand


@triton.jit
def _select(p_row, p_cand, n_scratch, n_cand, need, p_dst, CAND: tl.constexpr):
    """Append to p_dst the `need` largest of n_cand candidates, ties to the lowest index. The
    candidates are the scratch list when n_scratch (== n_cand) is positive, else the row's
    first n_cand entries."""
    o_c = tl.arange(0, CAND)
    m_c = o_c < n_cand
    m_s = o_c < n_scratch
    b_idx = tl.where(m_s, tl.load(p_cand + o_c, mask=m_s, other=0), o_c)
    b_key = _float_key(tl.load(p_row + b_idx, mask=m_c, other=0.0))
    lo = tl.min(tl.where(m_c, b_key, INT32_MAX))
    hi = tl.max(tl.where(m_c, b_key, INT32_MIN))
    t = _kth_key(b_key, m_c, need, lo, hi).to(tl.int32)
    b_gt = m_c & (b_key > t)
    b_eq = m_c & (b_key == t)
    n_gt = tl.sum(b_gt.to(tl.int32))
    b_eq_rank = tl.cumsum(b_eq.to(tl.int32), 0) - 1
    b_take = b_gt | (b_eq & (b_eq_rank < need - n_gt))
    o_dst = tl.cumsum(b_take.to(tl.int32), 0) - 1
    tl.store(p_dst + o_dst, b_idx, mask=b_take)


@triton.jit
def _topk_kernel(p_x, p_ks, p_ke, p_out, p_scratch, p_path, M, N, stride_xm, stride_om,
                 K: tl.constexpr, K_POW2: tl.constexpr, BLOCK: tl.constexpr,
                 CAND: tl.constexpr, RUNS: tl.constexpr, RUN: tl.constexpr, Z: tl.constexpr,
                 WITH_PATH: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    p_cand = p_scratch + pid.to(tl.int64) * CAND
    for row in range(pid, M, nprog):
        ks = tl.maximum(tl.load(p_ks + row), 0)
        ke = tl.minimum(tl.load(p_ke + row), N)
        length = tl.maximum(ke - ks, 0)
        row_64 = tl.cast(row, tl.int64)
        p_base = p_x + row_64 * stride_xm
        p_row = p_base + ks
        p_dst = p_out + row_64 * stride_om
        path = length * 0
        if length <= K:
            o_k = tl.arange(0, K_POW2)
            tl.store(p_dst + o_k, tl.where(o_k < length, o_k, -1), mask=o_k < K)
        else:
            use_scratch = length > CAND
            n_def = length * 0
            n_cand = length
            t_hi = length * 0
            t_lo = length * 0
            if use_scratch:
                seg = length // RUNS
                o_run = tl.arange(0, RUNS)
                b_h = (o_run + row * RUNS).to(tl.uint32) * 1103515245 + 12345
                b_h = b_h ^ (b_h >> 16)
                b_jitter = (b_h % (seg - RUN + 1).to(tl.uint32)).to(tl.int32)
                o_s = (o_run * seg + b_jitter)[:, None] + tl.arange(0, RUN)[None, :]
                b_skey = _float_key(tl.load(p_row + o_s))
                r = (K * RUNS * RUN) / length.to(tl.float32)
                spread = Z * tl.sqrt(r)
                need_hi = tl.floor(r - spread).to(tl.int32)
                need_lo = tl.ceil(r + spread).to(tl.int32) + 1
                k_hi, k_lo = _two_kth_keys(b_skey, tl.maximum(need_hi, 1),
                                           tl.minimum(need_lo, RUNS * RUN))
                # A rank outside the sample means no bound on that side.
                t_hi = tl.where(need_hi >= 1, k_hi, INT32_MAX).to(tl.int32)
                t_lo = tl.where(need_lo <= RUNS * RUN, k_lo, INT32_MIN).to(tl.int32)
                n_def, n_cand = _split_pass(p_base, ks, ke, t_hi, t_lo, p_dst, K, p_cand, CAND,
                                            BLOCK)
            if (n_def < K) & (n_def + n_cand >= K) & (n_cand <= CAND):
                _select(p_row, p_cand, tl.where(use_scratch, n_cand, 0), n_cand, K - n_def,
                        p_dst + n_def, CAND)
                path = length * 0 + 1 + use_scratch.to(tl.int32)
            else:
                # Only a sampled row gets here; narrow the search with what the pass counted.
                above = n_def >= K
                below = n_def + n_cand < K
                lo = tl.where(above, t_hi.to(tl.int64) + 1,
                              tl.where(below, INT32_MIN, t_lo.to(tl.int64)))
                hi = tl.where(above, INT32_MAX,
                              tl.where(below, t_lo.to(tl.int64) - 1, t_hi.to(tl.int64)))
                while lo < hi:
                    mid = lo + (hi - lo + 1) // 2
                    ok = _count_row(p_base, ks, ke, mid.to(tl.int32), False, BLOCK) >= K
                    lo = tl.where(ok, mid, lo)
                    hi = tl.where(ok, hi, mid - 1)
                t = lo.to(tl.int32)
                n_gt = _count_row(p_base, ks, ke, t, True, BLOCK)
                _split_pass(p_base, ks, ke, t, t, p_dst, K, p_dst + n_gt, K - n_gt, BLOCK)
                path = length * 0 + 3
        if WITH_PATH:
            tl.store(p_path + row, path.to(tl.int8))


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TopkConfig:
    """``block``: entries per step of a row pass; ``cand``: candidate capacity (rows up to this
    long skip the sample); ``runs`` x ``run``: the sample; ``z``: bracket half-width in
    standard deviations of the sample rank; ``programs_per_sm``: persistent programs per SM."""
    block: int = 2048
    cand: int = 4096
    runs: int = 512
    run: int = 8
    z: float = 5.0
    num_warps: int = 8
    programs_per_sm: int = 2

    def validate(self, k: int) -> None:
        for name in ("block", "cand", "runs", "run"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"TopkConfig.{name} must be a power of two, got {v}")
        if self.block >= 2**15:
            raise ValueError("TopkConfig.block must be below 32768 (16-bit packed counts)")
        if self.runs * self.run > min(self.cand, 2**15):
            raise ValueError("the sample (runs * run) must fit in cand and below 32768")
        if self.cand <= k:
            raise ValueError(f"TopkConfig.cand ({self.cand}) must exceed k ({k})")


def default_config(k: int, device: str = "cuda") -> TopkConfig:
    kp = triton.next_power_of_2(max(k, 1))
    if device == "cpu":
        # Interpreter: small blocks so that short test rows take every path.
        return TopkConfig(block=64, cand=max(128, 4 * kp), runs=16, run=4, z=3.0, num_warps=4,
                          programs_per_sm=1)
    # Compiled for sm_90, 8 warps with 4096 candidates take ~120 registers and no spills (two
    # programs per SM); 8192 candidates need 16 warps to stay unspilled.
    cand = max(4096, 2 * kp)
    return TopkConfig(cand=cand, num_warps=8 if cand <= 4096 else 16,
                      programs_per_sm=2 if cand <= 4096 else 1)


def _grid_size(m: int, device: torch.device, cfg: TopkConfig) -> int:
    if device.type == "cpu":
        return max(1, min(m, 3))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(m, sms * cfg.programs_per_sm))


def scratch_elems(m: int, device: torch.device, cfg: TopkConfig) -> int:
    """int32 elements of scratch a call over m rows needs (one candidate list per program)."""
    return _grid_size(m, device, cfg) * cfg.cand


def top_k_per_row(logits: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, k: int,
                  out: torch.Tensor | None = None, *, scratch: torch.Tensor | None = None,
                  config: TopkConfig | None = None, return_path: bool = False):
    """Top-k indices per row of ``logits[i, ks[i]:ke[i]]``, relative to ``ks[i]``.

    Shapes: logits float32 ``[M, N]`` (unit column stride, any row stride); ks, ke int32
    ``[M]``, clamped to ``[0, N]``; ``out`` int32 ``[M, k]`` with unit column stride (allocated
    if not given); ``scratch`` int32 with at least ``scratch_elems(M, device, config)``
    elements (allocated if not given; its size does not depend on N). Rows with fewer than k
    entries are padded with ``-1``. Entries inside a row's range must not be NaN.

    Returns ``out``, or ``(out, path)`` with ``return_path``: int8 ``[M]``, one of
    ``PATH_SHORT``, ``PATH_DIRECT``, ``PATH_SAMPLED``, ``PATH_FALLBACK`` per row.
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
    cfg = config or default_config(k, logits.device.type)
    cfg.validate(k)
    if out is None:
        out = torch.empty((m, k), dtype=torch.int32, device=logits.device)
    if out.shape != (m, k) or out.dtype != torch.int32 or (m > 0 and out.stride(1) != 1):
        raise ValueError(f"out must be int32 [{m}, {k}] with unit column stride")
    path = torch.empty(m if return_path else 1, dtype=torch.int8, device=logits.device)
    if m == 0:
        return (out, path) if return_path else out
    grid = _grid_size(m, logits.device, cfg)
    need = grid * cfg.cand
    if scratch is None:
        scratch = torch.empty(need, dtype=torch.int32, device=logits.device)
    elif scratch.dtype != torch.int32 or scratch.numel() < need or not scratch.is_contiguous():
        raise ValueError(f"scratch must be contiguous int32 with at least {need} elements")
    _topk_kernel[(grid,)](
        logits, ks, ke, out, scratch, path, m, n, logits.stride(0), out.stride(0),
        K=k, K_POW2=triton.next_power_of_2(k), BLOCK=cfg.block, CAND=cfg.cand, RUNS=cfg.runs,
        RUN=cfg.run, Z=cfg.z, WITH_PATH=return_path, num_warps=cfg.num_warps,
    )
    return (out, path) if return_path else out
