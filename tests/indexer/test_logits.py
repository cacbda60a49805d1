"""mqa_logits and paged_mqa_logits (indexer/logits.py, the portable kernel): against the float64
reference under the interpreter at small odd shapes, on a GPU at real shapes in bf16 and fp8
(every GPU family's tile among them), and compiled for each family's GPUs without spills; the
tile the runtime takes by the device's compute capability."""

import pytest
import torch
import triton

from indexer import (LogitsConfig, kv_offsets, mqa_logits, paged_mqa_logits, row_stride_elems,
                     top_k_per_row)
from indexer import logits as logits_mod
from indexer import reference as ref
from indexer import topk as topk_mod
from indexer._device import family_of
from indexer.logits_hopper import HopperConfig
from tests.support import indexer_gpu as gpu
from tests.support.aot import (GPUS, LOGITS_POINTERS, TRITON_DTYPE, compile_kernel, logits_ints,
                               resources, triton_newer_than)
from tests.support.indexer_cpu import FP32_TOL, make_inputs, make_paged, poisoned, rel_err


# --- under the interpreter -------------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("m,n,h,d", [(37, 101, 8, 32), (1, 5, 16, 16), (19, 66, 32, 64),
                                     (9, 40, 64, 32), (13, 29, 8, 128)])
@pytest.mark.parametrize("config", [None, LogitsConfig(32, 16, 4, 2), logits_mod.FAMILY_DEFAULTS["sm_120"]],
                         ids=["default", "32x16", "32x128"])
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


# Every family's tiles, run here (the H200 runs sm_90's code, not theirs): the tile's edges,
# masks and skipped tiles at odd M and N against the exact-input reference.
FAMILY_TILES = sorted({c for table in (logits_mod.FAMILY_DEFAULTS, logits_mod.FLOAT32_DEFAULTS)
                       for c in table.values()}, key=str)


@pytest.mark.gpu
@pytest.mark.parametrize("config", FAMILY_TILES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, gpu.FP8, torch.float32], ids=["bf16", "fp8", "fp32"])
def test_every_familys_tile_matches_the_reference(config, dtype):
    m, n, h, d = 1531, 7919, 64, 128
    g = gpu.gen(17)
    q32 = torch.randn(m, h, d, generator=g, device="cuda")
    kv32 = torch.randn(n, d, generator=g, device="cuda")
    w = torch.randn(m, h, generator=g, device="cuda") / h ** 0.5
    q, kv, row_scale = (q32, kv32, torch.ones(n, device="cuda")) if dtype == torch.float32 \
        else gpu.quantize(q32, kv32, dtype)
    kv_scale = ((torch.rand(n, generator=g, device="cuda") + 0.5) * row_scale).float()
    ks, ke = gpu.ragged_rows(m, n, g)
    buf = torch.full((m, row_stride_elems(n)), float("nan"), device="cuda")
    mqa_logits(q, kv, kv_scale, w, ks, ke, buf[:, :n], config=config)
    exact = ref.logits(q, kv, kv_scale, w, ks, ke)
    out = buf[:, :n]
    assert not out.isnan().any() and buf[:, n:].isnan().all()
    assert torch.equal(torch.isinf(out), torch.isinf(exact))
    assert rel_err(out, exact) < gpu.EXACT_TOL.get(dtype, FP32_TOL)


# --- compiled for each target GPU --------------------------------------------------------------


def portable_config(name, dtype, d):
    """The portable kernel's config on target ``name``, as a launch on that device takes it."""
    return logits_mod._portable_default(dtype, d, family_of(GPUS[name].capability))


def compile_logits(name, dtype, d, paged, cfg, h=64):
    t = TRITON_DTYPE[dtype]
    ints = logits_ints(h, d, paged) if dtype != torch.float32 else logits_ints(h, d, paged, m=37, n=101)
    return compile_kernel(
        logits_mod._logits_kernel, dict(LOGITS_POINTERS, p_q=t, p_kv=t), ints,
        dict(H=h, D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
             PAGED=paged, PAGE=64, CLEAN=True,
             DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32"),
        cfg.num_warps, cfg.num_stages, gpu=GPUS[name])


def known_stack(name, dtype, d):
    """Stack bytes known and kept: on Triton 3.6 (the H200's) ptxas keeps 8 bytes of sm_90's
    tile on the stack at bf16 and D = 128 (and of its float32 tile at D = 64), the tiles of the
    H200's recorded figures; 3.9 keeps none. (On sm_90, bf16 goes to the warp-specialized
    kernel; this tile takes what that kernel cannot.)"""
    return 8 if name == "sm_90" and d in (64, 128) and not triton_newer_than(3, 6) and (
        dtype == torch.bfloat16 and d == 128 or dtype == torch.float32 and d == 64) else 0


# fp8 products need sm_89 or later: the generic family's sm_80 compiles bf16 only, its sm_89 fp8.
TARGET_DTYPES = [(name, dtype) for name in GPUS for dtype in (torch.bfloat16, torch.float8_e4m3fn)
                 if not (name == "sm_80" and dtype != torch.bfloat16)
                 and not (name == "sm_89" and dtype == torch.bfloat16)]


@pytest.mark.compiled
@pytest.mark.parametrize("name,dtype", TARGET_DTYPES,
                         ids=[f"{n}-{TRITON_DTYPE[t]}" for n, t in TARGET_DTYPES])
@pytest.mark.parametrize("d", [32, 128])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_each_targets_tile_compiles_without_spills_two_programs_an_sm(name, dtype, d, paged):
    """The family's tile (FAMILY_DEFAULTS; on sm_90 a stage deeper at D <= 64) at the benchmark's 64
    heads: the target's tensor-core products, no stack, within the block's shared memory, and
    two programs resident on one SM (what overlaps one's relus with the other's products)."""
    gpu = GPUS[name]
    cfg = portable_config(name, dtype, d)
    kernel = compile_logits(name, dtype, d, paged, cfg)
    use, shared = resources(kernel), kernel.metadata.shared
    print(f"logits {name} {TRITON_DTYPE[dtype]} D={d} {'paged' if paged else 'dense'} "
          f"Triton {triton.__version__}: {cfg}, {use['REG']} registers, {use['STACK']} B stack, "
          f"{shared / 1024:.1f} KiB shared")
    assert gpu.mma in kernel.asm["ttgir"], f"expected {gpu.mma} products on {name}"
    assert use["STACK"] <= known_stack(name, dtype, d), f"{name} {cfg}: spills ({use})"
    assert shared <= gpu.shared_per_block
    assert gpu.fits(shared, use["REG"], 32 * cfg.num_warps, programs=2), (name, cfg, use, shared)


# sm_90's float32 tile spills at D = 128 (and at D = 64 on Triton 3.6): FLOAT32_DEFAULTS.
FLOAT32_CASES = [(name, d) for name in GPUS for d in (64, 128) if (name, d) != ("sm_90", 128)]


@pytest.mark.compiled
@pytest.mark.parametrize("name,d", FLOAT32_CASES, ids=[f"{n}-D{d}" for n, d in FLOAT32_CASES])
def test_float32_logits_kernel_compiles_for_each_target(name, d):
    cfg = portable_config(name, torch.float32, d)
    kernel = compile_logits(name, torch.float32, d, False, cfg, h=8)
    assert resources(kernel)["STACK"] <= known_stack(name, torch.float32, d), f"{name} {cfg}: spills"
    assert kernel.metadata.shared <= GPUS[name].shared_per_block


def test_the_runtime_takes_the_tile_of_the_devices_family():
    """default_config by compute capability, as _launch asks it with the device's: sm_90 keeps
    the warp-specialized kernel (bf16, fp8) and its portable tile for float32; B200 and B300,
    the RTX 50 series and GB10, and everything else get their family's tile; a tile chosen with
    set_config wins everywhere."""
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    defaults = logits_mod.FAMILY_DEFAULTS
    if logits_mod.hopper.AVAILABLE:
        assert isinstance(logits_mod.default_config(bf16, 64, 128, capability=(9, 0)), HopperConfig)
    assert logits_mod.default_config(torch.float32, 8, 64, capability=(9, 0)) == LogitsConfig(32, 64, 4, 2)
    assert logits_mod.default_config(bf16, 64, 64, capability=(9, 0)) == HopperConfig(3) or \
        not logits_mod.hopper.AVAILABLE
    assert logits_mod._portable_default(bf16, 64, "sm_90") == LogitsConfig(64, 128, 4, 4)
    assert defaults["sm_90"] == LogitsConfig(64, 128, 4, 3), "the H200's recorded figures use this tile"
    for cap, family in [((10, 0), "sm_100"), ((10, 3), "sm_100"), ((12, 0), "sm_120"),
                        ((12, 1), "sm_120"), ((8, 0), "generic"), ((8, 9), "generic"),
                        ((11, 0), "generic"), ((9, 0), "sm_90")]:
        tile = defaults[family]
        assert logits_mod._portable_default(bf16, 128, family_of(cap)) == tile
        if family != "sm_90":
            assert logits_mod.default_config(fp8, 64, 128, capability=cap) == tile
            assert logits_mod.default_config(bf16, 64, 64, paged=True, capability=cap) == tile
            assert logits_mod.default_config(torch.float32, 8, 128, capability=cap) == LogitsConfig(32, 32, 4, 2)
    pinned = LogitsConfig(64, 64, 4, 3)
    logits_mod.set_config(bf16, 64, 128, False, pinned)
    try:
        assert logits_mod.default_config(bf16, 64, 128, capability=(12, 1)) == pinned
    finally:
        logits_mod.set_config(bf16, 64, 128, False, None)
    assert defaults["sm_100"] == defaults["sm_120"] != defaults["sm_90"]


def test_the_sweep_keeps_what_fits_each_familys_shared_memory():
    """candidate_configs: on sm_90 the portable tiles its recorded sweeps timed; elsewhere the
    family's default first, and every tile's estimate within the family's shared memory."""
    def tiles(dtype, cap):
        return [c for c in logits_mod.candidate_configs(dtype, 64, 128, capability=cap)
                if isinstance(c, LogitsConfig)]
    for dtype in (torch.bfloat16, torch.float32):  # as before the families: within 200 KiB
        assert tiles(dtype, (9, 0)) == [
            c for c in logits_mod._CANDIDATES
            if (c.block_n + c.num_stages * c.block_m) * 128 * dtype.itemsize <= 200 * 1024]
    for cap in [(10, 0), (12, 1), (8, 6)]:
        family = family_of(cap)
        for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float32):
            found = tiles(dtype, cap)
            assert found[0] == logits_mod._portable_default(dtype, 128, family)
            assert all((c.block_n + c.num_stages * c.block_m) * 128 * dtype.itemsize
                       <= logits_mod.SHARED_PER_BLOCK[family] for c in found)
    assert len(tiles(torch.float32, (12, 1))) < len(tiles(torch.float32, (10, 0)))
