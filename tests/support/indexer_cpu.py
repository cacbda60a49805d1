"""Inputs and checks the indexer's kernel tests share on the CPU (under the interpreter), and
``rel_err`` for every mode: float32 inputs at small odd shapes, NaN-poisoned outputs, and a kv
scattered over the pages of a cache."""

import torch

from indexer import row_stride_elems

FP32_TOL = 1e-5


def make_inputs(m, n, h, d, seed, ragged=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(m, h, d, generator=g)
    kv = torch.randn(n, d, generator=g)
    kv_scale = torch.rand(n, generator=g) + 0.5
    w = torch.randn(m, h, generator=g)
    if ragged:
        ks = torch.randint(0, n, (m,), generator=g, dtype=torch.int32)
        ke = torch.minimum(ks + torch.randint(0, n + 1, (m,), generator=g, dtype=torch.int32),
                           torch.tensor(n, dtype=torch.int32)).to(torch.int32)
        ks[0], ke[0] = 0, n          # a full row
        if m > 1:
            ke[1] = ks[1]            # an empty row
    else:
        ks = torch.zeros(m, dtype=torch.int32)
        ke = torch.full((m,), n, dtype=torch.int32)
    return q, kv, kv_scale, w, ks, ke


def poisoned(m, n):
    """A NaN-filled buffer of row_stride_elems(n) columns and its [m, n] view."""
    buf = torch.full((m, row_stride_elems(n)), float("nan"))
    return buf, buf[:, :n]


def rel_err(out, want):
    finite = torch.isfinite(want)
    return ((out.double()[finite] - want[finite]).norm() / want[finite].norm()).item()


def make_paged(kv, kv_scale, kv_lens, page, seed, packed=False):
    """Scatter each request's kv rows into randomly chosen pages; returns the cache, its
    scale and the block table. With packed, the cache is a strided view into pages that
    also hold other bytes (as a vLLM page holds values and scales together)."""
    g = torch.Generator().manual_seed(seed)
    d = kv.shape[1]
    pages = [-(-n // page) for n in kv_lens]
    total = sum(pages) + 3
    if packed:
        store = torch.randn(total, page, d + 8, generator=g)
        cache = store[:, :, :d]
    else:
        cache = torch.randn(total, page, d, generator=g)
    scale = torch.rand(total, page, generator=g) + 7.0    # garbage where unused
    order = torch.randperm(total, generator=g).tolist()
    table = torch.full((len(kv_lens), max(pages + [1]) + 2), -1, dtype=torch.int32)
    start = 0
    for r, n in enumerate(kv_lens):
        for b in range(pages[r]):
            blk = order.pop()
            table[r, b] = blk
            rows = slice(start + b * page, start + min(n, (b + 1) * page))
            cnt = rows.stop - rows.start
            cache[blk, :cnt] = kv[rows]
            scale[blk, :cnt] = kv_scale[rows]
        start += n
    return cache, scale, table
