"""Inputs and tolerances the indexer's GPU tests share, at real shapes in bf16 and fp8.

Two references are used for the logits. ``exact``: the reference on the very inputs the kernel
got (bf16 or fp8 values upcast), so the only differences are the kernel's float32 arithmetic;
the tolerance is tight. ``truth``: the reference on the float32 data before quantization; the
tolerance is the dtype's (bf16 ~1e-2, fp8 e4m3 a few 1e-2; measured on the CPU for this data:
2.3e-3 and 3.7e-2). The agreement figures are printed by ``report``: run with ``-rA`` (or
``-s``) to see them.
"""

import json

import torch

FP8 = torch.float8_e4m3fn
K = 2048
EXACT_TOL = {torch.bfloat16: 1e-5, FP8: 2e-3}
TRUTH_TOL = {torch.bfloat16: 1e-2, FP8: 6e-2}
# tie-aware top-k agreement with the exact-input reference (mean, min over rows), and the mean
# with the truth (measured on the CPU: bf16 0.9986, fp8 0.978)
EXACT_AGREE = {torch.bfloat16: (0.9999, 0.999), FP8: (0.999, 0.99)}
TRUTH_AGREE = {torch.bfloat16: 0.99, FP8: 0.95}


def gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def quantize(q32, kv32, dtype):
    """(q, kv, per-row kv scale) in dtype; for fp8 kv rows are scaled to the e4m3 range."""
    if dtype == torch.bfloat16:
        return q32.bfloat16(), kv32.bfloat16(), torch.ones(kv32.shape[0], device=kv32.device)
    scale = kv32.abs().amax(1).clamp(min=1e-6) / 448.0
    return q32.to(FP8), (kv32 / scale[:, None]).to(FP8), scale


def ragged_rows(m, n, g):
    """Full rows, causal rows, random ranges, rows shorter than K and empty rows."""
    ks = torch.zeros(m, dtype=torch.int64, device="cuda")
    ke = torch.full((m,), n, dtype=torch.int64, device="cuda")
    kind = torch.arange(m, device="cuda") % 5
    causal = n - m + torch.arange(m, device="cuda") + 1
    ke = torch.where(kind == 1, causal.clamp(min=0), ke)
    lo = torch.randint(0, n, (m,), generator=g, device="cuda")
    hi = torch.randint(0, n + 1, (m,), generator=g, device="cuda")
    ks = torch.where(kind == 2, torch.minimum(lo, hi), ks)
    ke = torch.where(kind == 2, torch.maximum(lo, hi), ke)
    short = torch.randint(0, K, (m,), generator=g, device="cuda")
    ks = torch.where(kind == 3, n // 3, ks)
    ke = torch.where(kind == 3, n // 3 + short, ke)
    ks = torch.where(kind == 4, 17, ks)
    ke = torch.where((kind == 4) & (torch.arange(m, device="cuda") % 10 == 4), 17, ke)
    return ks.to(torch.int32), ke.clamp(max=n).to(torch.int32)


def report(**figures):
    print("indexer-gpu " + json.dumps({k: (round(v, 6) if isinstance(v, float) else v)
                                       for k, v in figures.items()}))


def make_paged(kv, kv_scale, kv_lens, page, g):
    d = kv.shape[1]
    pages = [-(-n // page) for n in kv_lens]
    total = sum(pages) + 5
    cache = torch.randn(total, page, d, generator=g, device="cuda").to(kv.dtype)
    scale = torch.rand(total, page, generator=g, device="cuda") + 3.0
    order = torch.randperm(total, generator=g, device="cuda").tolist()
    table = torch.zeros(len(kv_lens), max(pages) + 1, dtype=torch.int32, device="cuda")
    start = 0
    for r, n in enumerate(kv_lens):
        for b in range(pages[r]):
            blk = order.pop()
            table[r, b] = blk
            cnt = min(page, n - b * page)
            cache[blk, :cnt] = kv[start + b * page:start + b * page + cnt]
            scale[blk, :cnt] = kv_scale[start + b * page:start + b * page + cnt]
        start += n
    return cache, scale, table
