"""The head-weighted query ``q_w[i] = sum_h w[i, h] * q[i, h, :]``, split into parts in q's dtype
that tensor cores can multiply.

Why: ``relu(s) * w = (s * w + |s| * w) / 2``. Summed over the heads, the first half is
``q_w[i] . kv[j] / 2``, a single product where the per-head form needs a ``max`` for each head
and element. The sm_90 logits kernel (``HopperConfig.linear_terms``) runs that product on the
tensor cores, so each head costs it one ``FFMA`` an element (``|s|`` is an operand modifier)
instead of an ``FMNMX`` and an ``FFMA``.

q_w is a float32 sum; tensor cores take q's dtype. So q_w is written as ``terms`` parts,
``row_scale[i] * sum_k part_k[i]``: each part is the rounding, to q's dtype, of what the parts
before it left over. Each part carries about as many bits as the dtype's mantissa (fp8 e4m3:
4, bf16: 8), so three fp8 parts or two bf16 parts hold q_w to ~2^-12 or ~2^-16 of its size.
For fp8, ``row_scale`` puts each row's largest value at the e4m3 maximum (448), and for fp16
at 2^14, so that the later parts stay in the normal range; for bf16 (float32's exponent range)
it is 1.

``w_tiles`` writes w itself in the layout the same kernel's consumers read from shared memory
(transposed, scaled, rows interleaved; see ``logits_hopper``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import LAUNCH_OPTIONS

__all__ = ["split_weighted_q", "w_tiles", "FP8_MAX"]

FP8_MAX = 448.0
_FP8 = getattr(torch, "float8_e4m3fn", None)
# each row's largest value after scaling, by dtype (0: not scaled)
_ROW_MAX = {torch.float16: 2.0 ** 14, **({_FP8: FP8_MAX} if _FP8 is not None else {})}


@triton.jit
def _split_weighted_q_kernel(p_q, p_w, p_parts, p_row_scale, M, stride_qm, stride_qh,
                             stride_wm, stride_wh, stride_pm, H: tl.constexpr, D: tl.constexpr,
                             TERMS: tl.constexpr, DTYPE_MAX: tl.constexpr,
                             BLOCK_M: tl.constexpr):
    o_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, D)
    m_m = o_m < M
    p_q_rows = p_q + o_m.to(tl.int64)[:, None] * stride_qm + o_d[None, :]
    p_w_rows = p_w + o_m.to(tl.int64) * stride_wm
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for h in range(H):
        b_q = tl.load(p_q_rows + h * stride_qh, mask=m_m[:, None], other=0.0).to(tl.float32)
        b_w = tl.load(p_w_rows + h * stride_wh, mask=m_m, other=0.0)
        acc += b_q * b_w[:, None]
    if DTYPE_MAX > 0:
        b_scale = tl.max(tl.abs(acc), axis=1) / DTYPE_MAX
        b_scale = tl.where(b_scale > 0, b_scale, 1.0)
        acc = acc / b_scale[:, None]
    else:
        b_scale = tl.full([BLOCK_M], 1.0, tl.float32)
    tl.store(p_row_scale + o_m, b_scale, mask=m_m)
    p_parts_rows = p_parts + o_m.to(tl.int64)[:, None] * stride_pm + o_d[None, :]
    for k in tl.static_range(TERMS):
        b_part = acc.to(p_parts.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(p_parts_rows + k * D, b_part, mask=m_m[:, None])
        acc -= b_part.to(tl.float32)


def split_weighted_q(q: torch.Tensor, w: torch.Tensor, terms: int,
                     block_m: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``(parts [M, terms * D] in q's dtype, row_scale [M] float32)`` with
    ``row_scale[i] * sum_k parts[i, k*D:(k+1)*D] ~= sum_h w[i, h] * q[i, h, :]``.

    q ``[M, H, D]`` (bf16, fp16 or fp8 e4m3, unit stride over D), w ``[M, H]`` float32."""
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"q must be [M, H, D] with a contiguous last dimension, got "
                         f"{tuple(q.shape)} strides {q.stride()}")
    m, h, d = q.shape
    if w.shape != (m, h) or w.dtype != torch.float32:
        raise ValueError(f"w must be float32 [{m}, {h}], got {w.dtype} {tuple(w.shape)}")
    if terms < 1:
        raise ValueError(f"terms must be >= 1, got {terms}")
    if d & (d - 1):
        raise ValueError(f"D must be a power of two, got {d}")
    parts = torch.empty((m, terms * d), dtype=q.dtype, device=q.device)
    row_scale = torch.empty(m, dtype=torch.float32, device=q.device)
    if m:
        _split_weighted_q_kernel[(triton.cdiv(m, block_m),)](
            q, w, parts, row_scale, m, q.stride(0), q.stride(1), w.stride(0), w.stride(1),
            parts.stride(0), H=h, D=d, TERMS=terms,
            DTYPE_MAX=_ROW_MAX.get(q.dtype, 0.0), BLOCK_M=block_m, **LAUNCH_OPTIONS)
    return parts, row_scale


@triton.jit
def _w_tiles_kernel(p_w, p_wt, M, stride_wm, stride_wh, stride_t, H: tl.constexpr,
                    SCALE: tl.constexpr, BLOCK_M: tl.constexpr):
    o_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    # within each 16 rows: 0, 8, 1, 9, ..., 7, 15
    o_t = (o_m // 16) * 16 + (o_m % 8) * 2 + (o_m % 16) // 8
    p_w_rows = p_w + o_m.to(tl.int64) * stride_wm
    for h in range(H):
        b_w = tl.load(p_w_rows + h * stride_wh, mask=o_m < M, other=0.0)
        tl.store(p_wt + h * stride_t + o_t, b_w * SCALE)


def w_tiles(w: torch.Tensor, scale: float, block_m: int) -> torch.Tensor:
    """The weights as the sm_90 logits kernel's consumers read them: ``wt [H, M']`` float32,
    M rounded up to ``block_m`` (a multiple of 16) with zeros, ``wt[h, t(i)] = scale * w[i, h]``
    where t swaps row i's place within its 16 rows to 0, 8, 1, 9, ..., 7, 15. A thread of the
    wgmma layout holds rows r and r + 8 of each 16, which then lie side by side."""
    if w.dim() != 2 or w.dtype != torch.float32:
        raise ValueError(f"w must be float32 [M, H], got {w.dtype} {tuple(w.shape)}")
    if block_m % 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two multiple of 16, got {block_m}")
    m, h = w.shape
    wt = torch.empty((h, triton.cdiv(m, block_m) * block_m), dtype=torch.float32,
                     device=w.device)
    if m:
        _w_tiles_kernel[(triton.cdiv(m, block_m),)](
            w, wt, m, w.stride(0), w.stride(1), wt.stride(0), H=h, SCALE=scale,
            BLOCK_M=block_m, **LAUNCH_OPTIONS)
    return wt
