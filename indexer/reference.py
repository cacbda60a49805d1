"""Torch references for the indexer: the logits, the per-row top-k, and the checks that compare a
top-k against logits.

These are the definitions the Triton kernels are tested against, written for clarity and for
accuracy (float32 or float64), not speed. They run on any device.
"""

from __future__ import annotations

import torch

__all__ = ["logits", "topk", "topk_validity", "topk_agreement"]


def _row_chunk(m: int, h: int, n: int, elem_bytes: int, max_bytes: int) -> int:
    # The [rows, H, N] score tensor is the reference's only big temporary; bound it.
    return max(1, min(m, max_bytes // max(1, h * n * elem_bytes)))


def logits(q: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor, w: torch.Tensor,
           ks: torch.Tensor, ke: torch.Tensor, *, dtype: torch.dtype = torch.float64,
           max_temp_bytes: int = 1 << 30) -> torch.Tensor:
    """``logits[i, j] = kv_scale[j] * sum_h relu(q[i, h, :] . kv[j, :]) * w[i, h]`` for
    ``ks[i] <= j < ke[i]`` and ``-inf`` elsewhere, computed in ``dtype`` (float32 or float64).

    Shapes: q ``[M, H, D]``, kv ``[N, D]``, kv_scale ``[N]``, w ``[M, H]``, ks/ke ``[M]``;
    returns ``[M, N]`` in ``dtype``. Inputs of any float dtype (bf16, fp8) are upcast exactly.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"the reference computes in float32 or float64, not {dtype}")
    m, h, d = q.shape
    n = kv.shape[0]
    if kv.shape != (n, d) or kv_scale.shape != (n,) or w.shape != (m, h):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
                         f"kv_scale {tuple(kv_scale.shape)}, w {tuple(w.shape)}")
    if ks.shape != (m,) or ke.shape != (m,):
        raise ValueError(f"ks/ke must be [{m}], got {tuple(ks.shape)} and {tuple(ke.shape)}")
    out = torch.full((m, n), float("-inf"), dtype=dtype, device=q.device)
    if m == 0 or n == 0:
        return out
    kv_t = kv.to(dtype).t()
    scale = kv_scale.to(dtype)
    cols = torch.arange(n, device=q.device)
    step = _row_chunk(m, h, n, torch.finfo(dtype).bits // 8, max_temp_bytes)
    for r0 in range(0, m, step):
        r1 = min(m, r0 + step)
        s = (q[r0:r1].to(dtype).reshape(-1, d) @ kv_t).view(r1 - r0, h, n).relu_()
        part = torch.bmm(w[r0:r1].to(dtype).unsqueeze(1), s).squeeze(1) * scale
        inside = (cols >= ks[r0:r1, None].to(cols.dtype)) & (cols < ke[r0:r1, None].to(cols.dtype))
        out[r0:r1] = torch.where(inside, part, out[r0:r1])
    return out


def _row_mask(ks: torch.Tensor, ke: torch.Tensor, n: int) -> torch.Tensor:
    cols = torch.arange(n, device=ks.device)
    return (cols >= ks[:, None].long()) & (cols < ke[:, None].long())


def topk(logits: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the indices of the ``k`` largest entries of ``logits[i, ks[i]:ke[i]]``, relative
    to ``ks[i]``, largest first; ``-1`` pads rows with fewer than ``k`` entries.

    Shapes: logits ``[M, N]``, ks/ke ``[M]``; returns int32 ``[M, k]``. Entries inside a row's
    range are assumed finite (the logits are); ties are broken as ``torch.topk`` breaks them.
    """
    m, n = logits.shape
    out = torch.full((m, k), -1, dtype=torch.int32, device=logits.device)
    kk = min(k, n)
    if m == 0 or kk == 0:
        return out
    inside = _row_mask(ks, ke, n)
    masked = logits.masked_fill(~inside, float("-inf"))
    _, idx = torch.topk(masked, kk, dim=1)
    # Rows shorter than k pick up -inf columns from outside their range: those become -1.
    picked_inside = inside.gather(1, idx)
    rel = torch.where(picked_inside, idx - ks[:, None].long(), torch.full_like(idx, -1))
    out[:, :kk] = rel.to(torch.int32)
    return out


def _kth_values(ref: torch.Tensor, inside: torch.Tensor, kk: torch.Tensor) -> torch.Tensor:
    """Per row, the kk-th largest value of ref over the row's range (-inf where kk == 0)."""
    kmax = int(kk.max().item()) if kk.numel() else 0
    if kmax == 0:
        return torch.full((ref.shape[0],), float("-inf"), dtype=ref.dtype, device=ref.device)
    vals, _ = torch.topk(ref.masked_fill(~inside, float("-inf")), kmax, dim=1)
    pos = (kk - 1).clamp(min=0).long()
    kth = vals.gather(1, pos[:, None]).squeeze(1)
    return torch.where(kk > 0, kth, torch.full_like(kth, float("-inf")))


def topk_agreement(ref: torch.Tensor, idx: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor,
                   k: int) -> torch.Tensor:
    """Per row, the tie-aware fraction of ``idx`` (a top-k relative to ks, ``-1`` padded) that a
    top-k of ``ref`` could also have chosen, in [0, 1]; rows with no entries score 1.

    With ``kk = min(k, ke - ks)`` and ``t`` the kk-th largest ``ref`` value of the row: an index
    agrees if its value exceeds ``t``; indices whose value equals ``t`` agree up to the number of
    slots the ties fill in a true top-k. Out-of-range and repeated indices never agree.
    """
    m, n = ref.shape
    length = (ke.long() - ks.long()).clamp(min=0)
    kk = length.clamp(max=k)
    inside = _row_mask(ks, ke, n)
    t = _kth_values(ref, inside, kk)
    rel = idx.long()
    absolute = rel + ks[:, None].long()
    ok = (rel >= 0) & (rel < length[:, None])
    # A repeated index agrees at most once.
    srt, _ = torch.sort(torch.where(ok, rel, torch.full_like(rel, -1)), dim=1)
    dup = torch.zeros_like(ok)
    dup[:, 1:] = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    n_dup = dup.sum(1)
    vals = ref.gather(1, absolute.clamp(0, max(n - 1, 0)))
    above = (ok & (vals > t[:, None])).sum(1)
    ties = (ok & (vals == t[:, None])).sum(1)
    ref_above = (inside & (ref > t[:, None])).sum(1)
    agree = above + torch.minimum(ties, kk - ref_above) - n_dup
    frac = agree.clamp(min=0).double() / kk.clamp(min=1).double()
    return torch.where(kk > 0, frac, torch.ones_like(frac))


def topk_validity(logits: torch.Tensor, idx: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor,
                  k: int) -> torch.Tensor:
    """Per row, whether ``idx`` is exactly a top-k of ``logits`` (ties may be broken either way):
    ``min(k, ke - ks)`` distinct in-range indices that agree fully, and ``-1`` everywhere else."""
    length = (ke.long() - ks.long()).clamp(min=0)
    kk = length.clamp(max=k)
    rel = idx.long()
    n_valid = ((rel >= 0) & (rel < length[:, None])).sum(1)
    n_pad = (rel == -1).sum(1)
    full = topk_agreement(logits, idx, ks, ke, k) == 1.0
    return full & (n_valid == kk) & (n_pad == k - kk)
