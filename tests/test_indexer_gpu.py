"""The indexer on a GPU at real shapes: bf16 and fp8 logits against the float64 reference,
top-k agreement, ragged rows, paged against dense, and the prefill driver with and without the
arena allocator. Skipped without CUDA. The agreement figures are printed: run with ``-rA`` (or
``-s``) to see them.

Two references are used for the logits. ``exact``: the reference on the very inputs the kernel
got (bf16 or fp8 values upcast), so the only differences are the kernel's float32 arithmetic;
the tolerance is tight. ``truth``: the reference on the float32 data before quantization; the
tolerance is the dtype's (bf16 ~1e-2, fp8 e4m3 a few 1e-2; measured on the CPU for this data:
2.3e-3 and 3.7e-2).
"""

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from indexer import (DenseKV, PagedKV, PrefillStats, mqa_logits, paged_mqa_logits, prefill_topk,
                     row_stride_elems, token_ranges, top_k_per_row)
from indexer import logits as logits_mod
from indexer import reference as ref
from indexer import topk as topk_mod

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

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


def rel_err(out, want):
    finite = torch.isfinite(want)
    return ((out.double()[finite] - want[finite]).norm() / want[finite].norm()).item()


def report(**figures):
    print("indexer-gpu " + json.dumps({k: (round(v, 6) if isinstance(v, float) else v)
                                       for k, v in figures.items()}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("h", [64, 32])
def test_logits_and_topk_against_reference(dtype, h):
    m, n, d = 1531, 7919, 128
    g = gen(h + (1 if dtype == FP8 else 0))
    q32 = torch.randn(m, h, d, generator=g, device="cuda")
    kv32 = torch.randn(n, d, generator=g, device="cuda")
    w = torch.randn(m, h, generator=g, device="cuda") / h ** 0.5
    kv_scale0 = torch.rand(n, generator=g, device="cuda") + 0.5
    q, kv, row_scale = quantize(q32, kv32, dtype)
    kv_scale = (kv_scale0 * row_scale).float()
    ks, ke = ragged_rows(m, n, g)

    buf = torch.full((m, row_stride_elems(n)), float("nan"), device="cuda")
    out = buf[:, :n]
    mqa_logits(q, kv, kv_scale, w, ks, ke, out)
    torch.cuda.synchronize()
    exact = ref.logits(q, kv, kv_scale, w, ks, ke)
    truth = ref.logits(q32, kv32, kv_scale0, w, ks, ke)
    assert not out.isnan().any(), "unwritten entries"
    assert buf[:, n:].isnan().all(), "written beyond column N"
    assert torch.equal(torch.isinf(out), torch.isinf(exact)), "-inf exactly outside [ks, ke)"
    err_exact, err_truth = rel_err(out, exact), rel_err(out, truth)

    idx, path = top_k_per_row(out, ks, ke, K, return_path=True)
    valid = ref.topk_validity(out.double(), idx, ks, ke, K)
    agree_exact = ref.topk_agreement(exact, idx, ks, ke, K)
    agree_truth = ref.topk_agreement(truth, idx, ks, ke, K)
    torch_idx = ref.topk(exact, ks, ke, K)
    agree_torch = ref.topk_agreement(exact, torch_idx, ks, ke, K)
    report(test="logits+topk", dtype=str(dtype), H=h, M=m, N=n, rel_err_exact=err_exact,
           rel_err_truth=err_truth, topk_valid_rows=int(valid.sum()), rows=m,
           agree_exact_mean=agree_exact.mean().item(), agree_exact_min=agree_exact.min().item(),
           agree_truth_mean=agree_truth.mean().item(), agree_truth_min=agree_truth.min().item(),
           paths=topk_mod.path_counts(path))
    assert err_exact < EXACT_TOL[dtype]
    assert err_truth < TRUTH_TOL[dtype]
    assert valid.all(), "the top-k must be exact for the logits it was given"
    assert agree_torch.min().item() == 1.0, "sanity: torch.topk agrees with itself"
    mean_min = EXACT_AGREE[dtype]
    assert agree_exact.mean().item() >= mean_min[0] and agree_exact.min().item() >= mean_min[1]
    assert agree_truth.mean().item() >= TRUTH_AGREE[dtype]


@pytest.mark.parametrize("sampled", [True, False])
def test_topk_long_rows_ties_and_paths(sampled):
    m, n = 2048, 65536
    g = gen(7)
    x = torch.randn(m, n, generator=g, device="cuda")
    ks, ke = ragged_rows(m, n, g)
    x[5] = 1.0                                                  # all ties
    x[6] = torch.randint(0, 4, (n,), generator=g, device="cuda").float()
    cfg = dataclasses.replace(topk_mod.default_config(K), sampled=sampled)
    out, path = top_k_per_row(x, ks, ke, K, config=cfg, return_path=True)
    valid = ref.topk_validity(x.double(), out, ks, ke, K)
    counts = topk_mod.path_counts(path)
    report(test="topk", sampled=sampled, M=m, N=n, valid_rows=int(valid.sum()), paths=counts)
    assert valid.all()
    assert path[5].item() == path[6].item() == topk_mod.PATH_TIES  # > cand ties at the threshold
    # one read for most rows with the sampled threshold, two without
    assert counts["sampled" if sampled else "radix"] > m // 2
    assert counts["refined"] <= 10, "pass 1 should rarely need a second read"


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_paged_equals_dense(dtype):
    h, d, ratio, page = 64, 128, 4, 64
    context = [9001, 20000, 0, 3003]
    kv_lens = [c // ratio for c in context]
    n, m = sum(kv_lens), 1024
    g = gen(11)
    q, kv, row_scale = quantize(torch.randn(m, h, d, generator=g, device="cuda"),
                                torch.randn(n, d, generator=g, device="cuda"), dtype)
    kv_scale = row_scale * (torch.rand(n, generator=g, device="cuda") + 0.5)
    w = torch.randn(m, h, generator=g, device="cuda")
    ks, ke = ragged_rows(m, n, g)
    cache, scale, table = make_paged(kv, kv_scale, kv_lens, page, g)
    dense = mqa_logits(q, kv, kv_scale, w, ks, ke)
    paged = paged_mqa_logits(q, cache, scale, w, ks, ke, table,
                             torch.tensor(context, dtype=torch.int32, device="cuda"), ratio,
                             n_cols=n)
    assert torch.equal(dense, paged)


def portable_tol(dtype, cfg):
    """The sm_90 kernel against the portable one: float32 rounding, and with the linear half
    taken apart what the weighted q's parts leave (``weighted_q``): per part, 2^-4 of the rest
    at fp8, 2^-8 at bf16."""
    if not cfg.linear_terms:
        return 1e-5
    return max(1e-5, 4 * 2.0 ** (-(4 if dtype == FP8 else 8) * cfg.linear_terms))


def need_hopper():
    # Asked inside the tests: at import it would start CUDA in the arena child below, which
    # must install its allocator first.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialized kernel is for sm_90")


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("h,d", [(64, 128), (32, 64), (16, 32), (8, 128)])
@pytest.mark.parametrize("shape", [(3, 2), (6, 3), (3, 2, 2), (6, 3, 3)],
                         ids=["2-consumers", "3-consumers", "2-consumers-linear2",
                              "3-consumers-linear3"])
def test_hopper_kernel_matches_portable_and_reference(dtype, h, d, shape):
    """The warp-specialized sm_90 kernel (stages, consumers, linear terms) against the
    portable kernel and the exact-input reference, at odd M and N (partial tiles), on ragged
    rows, clean and not, dense and paged, within ``portable_tol``."""
    need_hopper()
    ws = logits_mod.HopperConfig(*shape)
    if not logits_mod.hopper.supports(dtype, h, d, ws):
        pytest.skip(f"{ws} does not fit shared memory at {dtype}, D={d}")
    m, n, ratio, page = 1000, 3001, 2, 16
    g = gen(100 + h + d)
    q, kv, row_scale = quantize(torch.randn(m, h, d, generator=g, device="cuda"),
                                torch.randn(n, d, generator=g, device="cuda"), dtype)
    kv_scale = (row_scale * (torch.rand(n, generator=g, device="cuda") + 0.5)).float()
    w = torch.randn(m, h, generator=g, device="cuda") / h ** 0.5
    ks, ke = ragged_rows(m, n, g)
    portable = logits_mod.LogitsConfig(64, 128, 4, 3)
    buf = torch.full((m, row_stride_elems(n)), float("nan"), device="cuda")
    out = buf[:, :n]
    mqa_logits(q, kv, kv_scale, w, ks, ke, out, config=ws)
    want = mqa_logits(q, kv, kv_scale, w, ks, ke, config=portable)
    exact = ref.logits(q, kv, kv_scale, w, ks, ke)
    assert buf[:, n:].isnan().all(), "written beyond column N"
    assert torch.equal(torch.isinf(out), torch.isinf(exact)), "-inf exactly outside [ks, ke)"
    err_portable, err_exact = rel_err(out, want.double()), rel_err(out, exact)
    report(test="hopper kernel", config=repr(ws), dtype=str(dtype), H=h, D=d,
           rel_err_portable=err_portable,
           rel_err_exact=err_exact)
    assert err_portable < portable_tol(dtype, ws) and err_exact < EXACT_TOL[dtype]

    # clean=False writes every tile that holds an in-range column, and only those
    poison = torch.full_like(buf, 7.0)
    mqa_logits(q, kv, kv_scale, w, ks, ke, poison[:, :n], clean=False, config=ws)
    inside = torch.isfinite(exact)
    assert torch.equal(poison[:, :n][inside], out[inside])

    # paged through a shuffled block table: bit-identical to dense
    context = torch.tensor([n * ratio // 3, 0, n * ratio - n * ratio // 3], dtype=torch.int32,
                           device="cuda")
    kv_lens = (context // ratio).tolist()
    kv_lens[-1] = n - sum(kv_lens[:-1])
    context[-1] = kv_lens[-1] * ratio
    cache, scale, table = make_paged(kv, kv_scale, kv_lens, page, g)
    paged = paged_mqa_logits(q, cache, scale, w, ks, ke, table, context, ratio, n_cols=n,
                             config=ws)
    assert torch.equal(paged, out)


def block_rows(m, n, g, block=64):
    """Rows whose ranges change by 64-row block (the sm_90 kernel's tile height), so that
    whole tiles lie outside every range: a causal staircase, empty blocks, a window in the
    middle (skipped tiles on both sides) and a tail."""
    i = torch.arange(m, device="cuda")
    kind = (i // block) % 4
    jitter = torch.randint(0, max(1, n // 50), (m,), generator=g, device="cuda")
    width = torch.randint(0, max(2, n // 5), (m,), generator=g, device="cuda")
    ks = torch.zeros(m, dtype=torch.int64, device="cuda")
    ke = (i + 1) * n // m
    ks = torch.where(kind == 1, n // 2, ks)
    ke = torch.where(kind == 1, n // 2, ke)
    ks = torch.where(kind == 2, n // 3 + jitter, ks)
    ke = torch.where(kind == 2, n // 3 + jitter + width, ke)
    ks = torch.where(kind == 3, (n - n // 10 - jitter).clamp(min=0), ks)
    ke = torch.where(kind == 3, n, ke)
    return ks.to(torch.int32), ke.clamp(max=n).to(torch.int32)


def active_tiles(ks, ke, n, block_m, block_n):
    """[M, N] bool: the entries of tiles (block_m x block_n) that hold a column inside some
    row's [ks, ke): the tiles the sm_90 kernel computes; it skips the others."""
    m = ks.shape[0]
    cols = torch.arange(n, device=ks.device)
    inside = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])
    pad = -m % block_m
    inside = torch.nn.functional.pad(inside, (0, -n % block_n, 0, pad))
    tiles = inside.view(inside.shape[0] // block_m, block_m, -1, block_n).any(3).any(1)
    return tiles.repeat_interleave(block_m, 0).repeat_interleave(block_n, 1)[:m, :n]


@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (3, 2)), (FP8, (6, 3, 3))],
                         ids=["bf16", "fp8"])
@pytest.mark.parametrize("m,n", [(4000, 5001), (20000, 300)], ids=["wide", "tall"])
def test_hopper_kernel_balanced_walk_skips_and_cleans_tiles(dtype, shape, m, n):
    """The sm_90 kernel's programs take the active tiles in turn, row blocks read in groups:
    many tiles a program ("wide"), and many row blocks a step with N shorter than a tile
    ("tall"), on rows whose ranges leave whole tiles outside. Every active tile is computed
    (against the portable kernel), clean=True writes -inf exactly outside [ks, ke), and
    clean=False leaves the skipped tiles as they were."""
    need_hopper()
    h, d = 64, 128
    ws = logits_mod.HopperConfig(*shape)
    g = gen(7 + m)
    q, kv, row_scale = quantize(torch.randn(m, h, d, generator=g, device="cuda"),
                                torch.randn(n, d, generator=g, device="cuda"), dtype)
    kv_scale = (row_scale * (torch.rand(n, generator=g, device="cuda") + 0.5)).float()
    w = torch.randn(m, h, generator=g, device="cuda") / h ** 0.5
    ks, ke = block_rows(m, n, g)
    active = active_tiles(ks, ke, n, logits_mod.hopper.BLOCK_M, ws.block_n)
    assert 0.2 < active.float().mean().item() < 0.9, "the rows must leave tiles to skip"
    buf = torch.full((m, row_stride_elems(n)), float("nan"), device="cuda")
    out = buf[:, :n]
    mqa_logits(q, kv, kv_scale, w, ks, ke, out, config=ws)
    want = mqa_logits(q, kv, kv_scale, w, ks, ke, config=logits_mod.LogitsConfig(64, 128, 4, 3))
    inside = torch.isfinite(want)
    assert buf[:, n:].isnan().all(), "written beyond column N"
    assert torch.equal(torch.isfinite(out), inside), "-inf exactly outside [ks, ke)"
    err = rel_err(out, want.double())
    report(test="hopper walk", config=repr(ws), M=m, N=n, active=active.float().mean().item(),
           rel_err_portable=err)
    assert err < portable_tol(dtype, ws)

    poison = torch.full_like(buf, 7.0)[:, :n]
    mqa_logits(q, kv, kv_scale, w, ks, ke, poison, clean=False, config=ws)
    assert (poison[~active] == 7.0).all(), "clean=False wrote into a skipped tile"
    assert torch.equal(poison[active], out[active]), "an active tile left unwritten"


@pytest.mark.parametrize("dtype,terms", [(FP8, 3), (FP8, 2), (torch.bfloat16, 2)])
def test_weighted_q_parts_round_to_nearest(dtype, terms):
    """On the GPU each part of the weighted q is its residual rounded to nearest, so the parts
    hold sum_h w q_h to 2^-(mantissa bits + 1) a part (fp8 e4m3: 2^-4, bf16: 2^-8) of each
    row's largest value."""
    from indexer.weighted_q import split_weighted_q
    g = gen(300 + terms)
    m, h, d = 1000, 64, 128
    q = quantize(torch.randn(m, h, d, generator=g, device="cuda"),
                 torch.randn(1, d, device="cuda"), dtype)[0]
    w = torch.randn(m, h, generator=g, device="cuda") / h ** 0.5
    parts, row_scale = split_weighted_q(q, w, terms)
    want = (q.double() * w.double()[:, :, None]).sum(1)
    got = parts.double().view(m, terms, d).sum(1) * row_scale.double()[:, None]
    err = ((got - want).abs().amax(1) / want.abs().amax(1)).max().item()
    bound = 2.0 ** (-(4 if dtype == FP8 else 8) * terms)
    report(test="weighted q parts", dtype=str(dtype), terms=terms, max_err=err, bound=bound)
    assert err <= bound + 5e-6          # plus the float32 sum over the heads


def test_hopper_config_rejects_inputs_it_cannot_take():
    need_hopper()
    q = torch.randn(64, 8, 128, device="cuda").bfloat16()[:, ::2]     # q's H stride is 2 * D
    kv = torch.randn(256, 128, device="cuda").bfloat16()
    ks = torch.zeros(64, dtype=torch.int32, device="cuda")
    ke = torch.full((64,), 256, dtype=torch.int32, device="cuda")
    args = (q, kv, torch.ones(256, device="cuda"), torch.ones(64, 4, device="cuda"), ks, ke)
    with pytest.raises(ValueError, match="LogitsConfig"):
        mqa_logits(*args, config=logits_mod.HopperConfig())
    # without a config, the portable kernel takes them
    assert torch.isfinite(mqa_logits(*args)).all()
    # an out whose rows are 16-byte multiples but whose base is not (the -inf tiles are TMA
    # stores): the same
    q = q.contiguous()
    out = torch.empty(64, 264, device="cuda")[:, 1:257]
    args = (q, kv, torch.ones(256, device="cuda"), torch.ones(64, 4, device="cuda"), ks, ke, out)
    with pytest.raises(ValueError, match="LogitsConfig"):
        mqa_logits(*args, config=logits_mod.HopperConfig())
    assert torch.isfinite(mqa_logits(*args)).all()


# --- the driver --------------------------------------------------------------------------------

QUERY_LENS = [2048, 100, 3000]
SEQ_LENS = [16384, 100, 12000]
RATIO = 4
BUDGET = 16 << 20


def driver_batch(seed=21):
    g = gen(seed)
    t = sum(QUERY_LENS)
    nkv = sum(s // RATIO for s in SEQ_LENS)
    q, kv, row_scale = quantize(torch.randn(t, 64, 128, generator=g, device="cuda"),
                                torch.randn(nkv, 128, generator=g, device="cuda"), FP8)
    w = torch.randn(t, 64, generator=g, device="cuda") / 8
    return q, w, kv, row_scale.float()


def alloc_available() -> bool:
    try:
        import alloc  # noqa: F401
    except ImportError:
        return False
    return True


def run_driver(stats=None):
    q, w, kv, kv_scale = driver_batch()
    # The default scope is alloc.workspace(); without a built alloc extension, a no-op scope.
    scope = None if alloc_available() else contextlib.nullcontext
    return prefill_topk(q, w, QUERY_LENS, SEQ_LENS, DenseKV(kv, kv_scale), k=K,
                        max_logits_bytes=BUDGET, compress_ratio=RATIO, stats=stats,
                        workspace=scope)


def test_prefill_driver_matches_whole_request_computation():
    stats = PrefillStats()
    got = run_driver(stats)
    assert torch.equal(run_driver(), got), "timing a call must not change its indices"
    q, w, kv, kv_scale = driver_batch()
    ks, ke = token_ranges(QUERY_LENS, SEQ_LENS, RATIO)
    ks, ke = ks.cuda(), ke.cuda()
    t0 = c0 = 0
    agreements = []
    for ql, sl in zip(QUERY_LENS, SEQ_LENS):
        rows, cols = slice(t0, t0 + ql), slice(c0, c0 + sl // RATIO)
        whole = mqa_logits(q[rows], kv[cols], kv_scale[cols], w[rows], ks[rows], ke[rows])
        want = top_k_per_row(whole, ks[rows], ke[rows], K)
        # the same set per row; the order inside a row depends on which path a row took
        assert torch.equal(got[rows].sort(1).values, want.sort(1).values)
        exact = ref.logits(q[rows], kv[cols], kv_scale[cols], w[rows], ks[rows], ke[rows])
        agreements.append(ref.topk_agreement(exact, got[rows], ks[rows], ke[rows], K))
        t0, c0 = t0 + ql, c0 + sl // RATIO
    agree = torch.cat(agreements)
    # the paged driver on the same kv, scattered over a cache: the same indices
    kv_lens = [s // RATIO for s in SEQ_LENS]
    cache, scale, table = make_paged(kv, kv_scale, kv_lens, 64, gen(22))
    scope = None if alloc_available() else contextlib.nullcontext
    paged = prefill_topk(q, w, QUERY_LENS, SEQ_LENS, PagedKV(cache, scale, table), k=K,
                         max_logits_bytes=BUDGET, compress_ratio=RATIO, workspace=scope)
    assert torch.equal(paged, got)
    report(test="driver", pieces=stats.pieces, max_piece_bytes=stats.max_piece_bytes,
           budget=BUDGET, agree_exact_mean=agree.mean().item(), agree_exact_min=agree.min().item())
    assert stats.pieces > 3 and stats.max_piece_bytes <= BUDGET
    assert agree.mean().item() >= EXACT_AGREE[FP8][0]


@pytest.mark.parametrize("scope", ["process", "workspace"])
def test_prefill_same_indices_with_and_without_the_arena(tmp_path, scope):
    if not alloc_available():
        pytest.skip("the alloc extension is not built")
    plain = run_driver().cpu()
    out = tmp_path / "arena.pt"
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("INDEXER_ARENA_CONF", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--arena-child",
                           str(out), scope], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    report(test="arena", **child)
    assert child["scope"] == scope
    if scope == "process":
        assert child["workspace_requests"] == child["pieces"], "every logits buffer from the arena"
        assert child["max_piece_bytes"] <= child["workspace_peak"] <= 64 << 20
    else:  # PyTorch's pool splits every piece out of the one segment the arena gave it
        # (and, for pieces of 1 MiB or less, the one small-block segment beside it)
        assert child["pool_segments"] in ([64 << 20], [64 << 20, 2 << 20]), child
        assert child["workspace_requests"] == len(child["pool_segments"])
    assert torch.equal(torch.load(out), plain)


def _arena_child(path: str, scope: str) -> None:
    import alloc
    alloc.install(alloc.Config(budget_mb=64), scope=scope)
    stats = PrefillStats()
    idx = run_driver(stats)
    torch.cuda.synchronize()
    ms = alloc.memory_stats()
    torch.save(idx.cpu(), path)
    out = dict(scope=alloc.installed_scope(), pieces=stats.pieces,
               max_piece_bytes=stats.max_piece_bytes,
               workspace_requests=int(ms["arena.workspace.blocks_allocated"]),
               workspace_peak=int(ms["arena.workspace.in_use_peak"]))
    if scope == "workspace":
        out["pool_segments"] = sorted((s["total_size"] for s in alloc.pool_snapshot(0)), reverse=True)
    print(json.dumps(out))


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--arena-child":
    _arena_child(sys.argv[2], sys.argv[3])
