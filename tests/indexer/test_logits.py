"""mqa_logits and paged_mqa_logits (indexer/logits.py, the portable kernel): against the float64
reference under the interpreter at small odd shapes, on a GPU at real shapes in bf16 and fp8,
and compiled for sm_90 without spills."""

import pytest
import torch

from indexer import (LogitsConfig, kv_offsets, mqa_logits, paged_mqa_logits, row_stride_elems,
                     top_k_per_row)
from indexer import logits as logits_mod
from indexer import reference as ref
from indexer import topk as topk_mod
from tests.support import indexer_gpu as gpu
from tests.support.indexer_cpu import FP32_TOL, make_inputs, make_paged, poisoned, rel_err
from tests.support.sm90 import LOGITS_POINTERS, TRITON_DTYPE, compile_kernel, logits_ints, resources


# --- under the interpreter -------------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("m,n,h,d", [(37, 101, 8, 32), (1, 5, 16, 16), (19, 66, 32, 64),
                                     (9, 40, 64, 32), (13, 29, 8, 128)])
@pytest.mark.parametrize("config", [None, LogitsConfig(32, 16, 4, 2)], ids=["default", "32x16"])
def test_logits_match_reference(m, n, h, d, config):
    args = make_inputs(m, n, h, d, seed=m * 1000 + n + h)
    buf, out = poisoned(m, n)
    mqa_logits(*args, out, config=config)
    want = ref.logits(*args)
    assert not out.isnan().any(), "every entry of [M, N] must be written"
    assert buf[:, n:].isnan().all(), "nothing beyond column N may be written"
    assert torch.equal(torch.isinf(out), torch.isinf(want)), "-inf exactly outside [ks, ke)"
    assert (out[torch.isinf(out)] < 0).all()
    assert rel_err(out, want) < FP32_TOL


@pytest.mark.interpreter
def test_logits_unclean_writes_rows_in_range_and_skips_outside_tiles():
    m, n = 40, 150
    q, kv, kv_scale, w, _, _ = make_inputs(m, n, 8, 32, seed=11)
    # causal rows at the end of a sequence: many tiles lie wholly above the diagonal
    ks = torch.zeros(m, dtype=torch.int32)
    ke = (torch.arange(m, dtype=torch.int32) + (n - 2 * m) + 1).to(torch.int32)
    buf, out = poisoned(m, n)
    mqa_logits(q, kv, kv_scale, w, ks, ke, out, clean=False)
    want = ref.logits(q, kv, kv_scale, w, ks, ke)
    finite = torch.isfinite(want)
    assert torch.isfinite(out[finite]).all()
    assert rel_err(out, want) < FP32_TOL
    outside = out[~finite]
    assert (outside.isnan() | (outside == float("-inf"))).all()
    assert outside.isnan().any(), "a tile outside every row's range must be skipped"
    # and clean=True fills exactly those with -inf
    buf2, out2 = poisoned(m, n)
    mqa_logits(q, kv, kv_scale, w, ks, ke, out2)
    assert torch.equal(torch.isinf(out2), ~finite)


@pytest.mark.interpreter
def test_logits_defaults_allocate_an_aligned_output():
    args = make_inputs(7, 13, 8, 32, seed=12)
    out = mqa_logits(*args)
    assert out.shape == (7, 13) and out.stride(0) % 4 == 0
    assert rel_err(out, ref.logits(*args)) < FP32_TOL


@pytest.mark.interpreter
def test_logits_reject_misaligned_or_mismatched_arguments():
    q, kv, kv_scale, w, ks, ke = make_inputs(6, 10, 8, 32, seed=13)
    with pytest.raises(ValueError, match="16 bytes"):
        mqa_logits(q, kv, kv_scale, w, ks, ke, torch.empty(6, 13)[:, :10])
    with pytest.raises(ValueError, match="share a dtype"):
        mqa_logits(q, kv.double(), kv_scale, w, ks, ke)
    with pytest.raises(ValueError, match="int32"):
        mqa_logits(q, kv, kv_scale, w, ks.long(), ke)


@pytest.mark.interpreter
def test_logits_empty_shapes_launch_nothing():
    q, kv, kv_scale, w, ks, ke = make_inputs(4, 8, 8, 32, seed=14)
    assert mqa_logits(q[:0], kv, kv_scale, w[:0], ks[:0], ke[:0]).shape == (0, 8)
    zero = torch.zeros(4, dtype=torch.int32)
    assert mqa_logits(q, kv[:0], kv_scale[:0], w, zero, zero).shape == (4, 0)


@pytest.mark.interpreter
@pytest.mark.parametrize("page,ratio,packed", [(4, 1, False), (16, 4, True), (1, 2, False)])
def test_paged_logits_equal_dense(page, ratio, packed):
    context = [37, 0, 64, 5, 90]
    kv_lens = [c // ratio for c in context]
    n = sum(kv_lens)
    m = 23
    q, kv, kv_scale, w, ks, ke = make_inputs(m, n, 8, 32, seed=page * 10 + ratio)
    cache, scale, table = make_paged(kv, kv_scale, kv_lens, page, seed=5, packed=packed)
    dense_buf, dense = poisoned(m, n)
    mqa_logits(q, kv, kv_scale, w, ks, ke, dense)
    paged_buf, paged = poisoned(m, n)
    paged_mqa_logits(q, cache, scale, w, ks, ke, table,
                     torch.tensor(context, dtype=torch.int32), ratio, paged)
    assert torch.equal(dense_buf.nan_to_num(1.0), paged_buf.nan_to_num(1.0))
    assert rel_err(paged, ref.logits(q, kv, kv_scale, w, ks, ke)) < FP32_TOL
    # the cu_kv shortcut and an allocated output give the same
    cu = kv_offsets(torch.tensor(context, dtype=torch.int32), ratio)
    again = paged_mqa_logits(q, cache, scale, w, ks, ke, table, cu_kv=cu, n_cols=n)
    assert torch.equal(again, dense)


# --- on a GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, gpu.FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("h", [64, 32])
def test_logits_and_topk_against_reference(dtype, h):
    m, n, d = 1531, 7919, 128
    g = gpu.gen(h + (1 if dtype == gpu.FP8 else 0))
    q32 = torch.randn(m, h, d, generator=g, device="cuda")
    kv32 = torch.randn(n, d, generator=g, device="cuda")
    w = torch.randn(m, h, generator=g, device="cuda") / h ** 0.5
    kv_scale0 = torch.rand(n, generator=g, device="cuda") + 0.5
    q, kv, row_scale = gpu.quantize(q32, kv32, dtype)
    kv_scale = (kv_scale0 * row_scale).float()
    ks, ke = gpu.ragged_rows(m, n, g)

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

    idx, path = top_k_per_row(out, ks, ke, gpu.K, return_path=True)
    valid = ref.topk_validity(out.double(), idx, ks, ke, gpu.K)
    agree_exact = ref.topk_agreement(exact, idx, ks, ke, gpu.K)
    agree_truth = ref.topk_agreement(truth, idx, ks, ke, gpu.K)
    torch_idx = ref.topk(exact, ks, ke, gpu.K)
    agree_torch = ref.topk_agreement(exact, torch_idx, ks, ke, gpu.K)
    gpu.report(test="logits+topk", dtype=str(dtype), H=h, M=m, N=n, rel_err_exact=err_exact,
               rel_err_truth=err_truth, topk_valid_rows=int(valid.sum()), rows=m,
               agree_exact_mean=agree_exact.mean().item(), agree_exact_min=agree_exact.min().item(),
               agree_truth_mean=agree_truth.mean().item(), agree_truth_min=agree_truth.min().item(),
               paths=topk_mod.path_counts(path))
    assert err_exact < gpu.EXACT_TOL[dtype]
    assert err_truth < gpu.TRUTH_TOL[dtype]
    assert valid.all(), "the top-k must be exact for the logits it was given"
    assert agree_torch.min().item() == 1.0, "sanity: torch.topk agrees with itself"
    mean_min = gpu.EXACT_AGREE[dtype]
    assert agree_exact.mean().item() >= mean_min[0] and agree_exact.min().item() >= mean_min[1]
    assert agree_truth.mean().item() >= gpu.TRUTH_AGREE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, gpu.FP8], ids=["bf16", "fp8"])
def test_paged_equals_dense(dtype):
    h, d, ratio, page = 64, 128, 4, 64
    context = [9001, 20000, 0, 3003]
    kv_lens = [c // ratio for c in context]
    n, m = sum(kv_lens), 1024
    g = gpu.gen(11)
    q, kv, row_scale = gpu.quantize(torch.randn(m, h, d, generator=g, device="cuda"),
                                    torch.randn(n, d, generator=g, device="cuda"), dtype)
    kv_scale = row_scale * (torch.rand(n, generator=g, device="cuda") + 0.5)
    w = torch.randn(m, h, generator=g, device="cuda")
    ks, ke = gpu.ragged_rows(m, n, g)
    cache, scale, table = gpu.make_paged(kv, kv_scale, kv_lens, page, g)
    dense = mqa_logits(q, kv, kv_scale, w, ks, ke)
    paged = paged_mqa_logits(q, cache, scale, w, ks, ke, table,
                             torch.tensor(context, dtype=torch.int32, device="cuda"), ratio,
                             n_cols=n)
    assert torch.equal(dense, paged)


# --- compiled for sm_90 ----------------------------------------------------------------------


@pytest.mark.compiled
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("d", [32, 128])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_logits_kernel_compiles_for_sm90_without_spills(dtype, d, paged):
    cfg = logits_mod.default_config(dtype, 64, d, paged)
    t = TRITON_DTYPE[dtype]
    kernel = compile_kernel(
        logits_mod._logits_kernel, dict(LOGITS_POINTERS, p_q=t, p_kv=t),
        logits_ints(64, d, paged),
        dict(H=64, D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
             PAGED=paged, PAGE=64, CLEAN=True, DOT_PRECISION="tf32"),
        cfg.num_warps, cfg.num_stages)
    assert "warp_group_dot" in kernel.asm["ttgir"], "expected Hopper wgmma"
    use = resources(kernel)
    assert use["STACK"] == 0, f"{cfg}: spills ({use})"


@pytest.mark.compiled
def test_float32_logits_kernel_compiles():
    cfg = logits_mod.default_config(torch.float32, 8, 64)
    kernel = compile_kernel(
        logits_mod._logits_kernel, dict(LOGITS_POINTERS, p_q="fp32", p_kv="fp32"),
        logits_ints(8, 64, False, m=37, n=101),
        dict(H=8, D=64, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
             PAGED=False, PAGE=1, CLEAN=False, DOT_PRECISION="ieee"),
        cfg.num_warps, cfg.num_stages)
    assert resources(kernel)["STACK"] == 0
