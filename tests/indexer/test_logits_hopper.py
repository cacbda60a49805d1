"""The warp-specialized sm_90 logits kernel (indexer/logits_hopper.py, Gluon): its configuration's
checks; on a Hopper GPU against the portable kernel and the reference, with the balanced walk
skipping and cleaning tiles; compiled for sm_90 with partitions and wgmma, within shared memory
and without spills in its product loops."""

import pytest
import torch
import triton

from indexer import mqa_logits, paged_mqa_logits, row_stride_elems
from indexer import logits as logits_mod
from indexer import reference as ref
from indexer.logits_hopper import HopperConfig
from tests.support import indexer_gpu as gpu
from tests.support.aot import source_api_differs
from tests.support.indexer_cpu import rel_err
from indexer._launch import LAUNCH_OPTIONS
from tests.support.aot import (LOGITS_POINTERS, TARGET, TRITON_DTYPE, product_loops, resources,
                               spill_ops)


# --- the configuration -----------------------------------------------------------------------


def test_hopper_config_checks_its_values():
    assert repr(HopperConfig(6, 3, 3)) == "wgmma 64x384 s6 linear3"
    assert HopperConfig(6, 3, 3) != HopperConfig(6, 3) and HopperConfig(6, 3).linear_terms == 0
    for bad in (dict(stages=1), dict(consumers=4), dict(linear_terms=5),
                dict(linear_terms=-1)):
        with pytest.raises(ValueError, match="HopperConfig"):
            HopperConfig(**bad)


# --- on a Hopper GPU -------------------------------------------------------------------------


def portable_tol(dtype, cfg):
    """The sm_90 kernel against the portable one: float32 rounding, and with the linear half
    taken apart what the weighted q's parts leave (``weighted_q``): per part, 2^-4 of the rest
    at fp8, 2^-8 at bf16."""
    if not cfg.linear_terms:
        return 1e-5
    return max(1e-5, 4 * 2.0 ** (-(4 if dtype == gpu.FP8 else 8) * cfg.linear_terms))


def need_hopper():
    # Asked inside the tests: at import it would start CUDA in the arena child below, which
    # must install its allocator first.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialized kernel is for sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, gpu.FP8], ids=["bf16", "fp8"])
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
    g = gpu.gen(100 + h + d)
    q, kv, row_scale = gpu.quantize(torch.randn(m, h, d, generator=g, device="cuda"),
                                    torch.randn(n, d, generator=g, device="cuda"), dtype)
    kv_scale = (row_scale * (torch.rand(n, generator=g, device="cuda") + 0.5)).float()
    w = torch.randn(m, h, generator=g, device="cuda") / h ** 0.5
    ks, ke = gpu.ragged_rows(m, n, g)
    portable = logits_mod.LogitsConfig(64, 128, 4, 3)
    buf = torch.full((m, row_stride_elems(n)), float("nan"), device="cuda")
    out = buf[:, :n]
    mqa_logits(q, kv, kv_scale, w, ks, ke, out, config=ws)
    want = mqa_logits(q, kv, kv_scale, w, ks, ke, config=portable)
    exact = ref.logits(q, kv, kv_scale, w, ks, ke)
    assert buf[:, n:].isnan().all(), "written beyond column N"
    assert torch.equal(torch.isinf(out), torch.isinf(exact)), "-inf exactly outside [ks, ke)"
    err_portable, err_exact = rel_err(out, want.double()), rel_err(out, exact)
    gpu.report(test="hopper kernel", config=repr(ws), dtype=str(dtype), H=h, D=d,
               rel_err_portable=err_portable,
               rel_err_exact=err_exact)
    assert err_portable < portable_tol(dtype, ws) and err_exact < gpu.EXACT_TOL[dtype]

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
    cache, scale, table = gpu.make_paged(kv, kv_scale, kv_lens, page, g)
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (3, 2)), (gpu.FP8, (6, 3, 3))],
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
    g = gpu.gen(7 + m)
    q, kv, row_scale = gpu.quantize(torch.randn(m, h, d, generator=g, device="cuda"),
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
    gpu.report(test="hopper walk", config=repr(ws), M=m, N=n, active=active.float().mean().item(),
               rel_err_portable=err)
    assert err < portable_tol(dtype, ws)

    poison = torch.full_like(buf, 7.0)[:, :n]
    mqa_logits(q, kv, kv_scale, w, ks, ke, poison, clean=False, config=ws)
    assert (poison[~active] == 7.0).all(), "clean=False wrote into a skipped tile"
    assert torch.equal(poison[active], out[active]), "an active tile left unwritten"


@pytest.mark.gpu
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


# --- compiled for sm_90 ----------------------------------------------------------------------


@pytest.mark.compiled
def test_hopper_weights_row_layout_reads_rows_where_w_tiles_put_them():
    """The consumers read a head's weights through ``w_layouts()[1]``: memory offset o holds
    the row that the layout's offset bases sum to, which must be the row ``w_tiles`` put at o
    (row i goes to i // 16 * 16 + i % 8 * 2 + i % 16 // 8)."""
    from indexer import logits_hopper as hopper
    if not hopper.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    bases = [b[0] for b in hopper.w_layouts()[1].offset_bases]
    assert 1 << len(bases) == hopper.BLOCK_M
    for i in range(hopper.BLOCK_M):
        o = i // 16 * 16 + i % 8 * 2 + i % 16 // 8
        row = 0
        for bit, base in enumerate(bases):
            if o >> bit & 1:
                row ^= base
        assert row == i, (i, o, row)


def compile_hopper_kernel(dtype, d, h, paged, cfg):
    """The warp-specialized sm_90 logits kernel (Gluon) as its launcher would compile it."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from indexer import logits_hopper as hopper
    q_smem, kv_smem, kv_load, chunk = hopper.layouts(dtype, d)
    t = TRITON_DTYPE[dtype]
    fn = hopper._logits_ws_kernel
    maxnreg, consumer_regs, producer_regs = cfg.registers()
    consts = dict(H=h, D=d, STAGES=cfg.stages, NC=cfg.consumers, PAGED=paged, PAGE=64,
                  CLEAN=True, KV_SMEM=kv_smem, KV_LOAD=kv_load, CHUNK=chunk,
                  CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
                  TERMS=cfg.linear_terms, W_ROW=hopper.w_layouts()[1])
    pointers = dict(LOGITS_POINTERS, p_kv=t, p_row_scale="fp32")
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name in ("q_desc", "qw_desc") or (name == "kv_desc" and paged):
            signature[name] = f"tensordesc<{t}[{hopper.BLOCK_M}, {d}],{q_smem!r}>"
        elif name == "kv_desc":
            signature[name] = f"tensordesc<{t}[{hopper.PART_N}, {d}],{kv_smem!r}>"
        elif name == "w_desc":
            signature[name] = f"tensordesc<fp32[{h}, {hopper.BLOCK_M}],{hopper.w_layouts()[0]!r}>"
        elif name == "out_desc":
            signature[name] = (f"tensordesc<fp32[{hopper.FILL_ROWS}, {hopper.PART_N}],"
                               f"{hopper.w_layouts()[0]!r}>")
        elif name in pointers:
            signature[name] = "*" + pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
    differs = source_api_differs(GluonASTSource)
    if differs:  # this Triton describes kernels differently; not a kernel bug
        pytest.skip(f"GluonASTSource API differs in Triton {triton.__version__}: {differs}")
    src = GluonASTSource(fn, signature, consts, attrs)  # a TypeError from inside it is a failure
    return triton.compile(src, target=TARGET,
                          options=dict(LAUNCH_OPTIONS, num_warps=4, maxnreg=maxnreg))


# The configs the defaults and the sweep choose from: their product loops must hold no spill
# loads or stores (elsewhere a few do no harm), but for the one case below. With the linear
# half taken apart, a head costs one FFMA an element and no FMNMX.
@pytest.mark.compiled
@pytest.mark.parametrize("dtype,stages,consumers,linear", [
    (torch.bfloat16, 3, 2, 0), (torch.float8_e4m3fn, 4, 2, 0), (torch.float8_e4m3fn, 6, 3, 0),
    (torch.float8_e4m3fn, 6, 3, 3), (torch.float8_e4m3fn, 4, 2, 3)])
@pytest.mark.parametrize("d", [32, 128])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_hopper_logits_kernel_compiles_with_partitions_and_wgmma(dtype, stages, consumers, linear,
                                                                 d, paged):
    from indexer import logits_hopper as hopper
    if not hopper.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    cfg = hopper.HopperConfig(stages, consumers, linear)
    if not hopper.supports(dtype, 64, d, cfg):
        pytest.skip(f"{cfg} does not fit shared memory at {dtype}, D={d}, 64 heads")
    kernel = compile_hopper_kernel(dtype, d, 64, paged, cfg)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx, "expected wgmma in partitions"
    assert kernel.metadata.shared <= 227 * 1024
    loops = product_loops(kernel)
    # One product loop per consumer (ptxas may keep a second copy of a loop).
    assert len(loops) >= consumers, f"found {len(loops)} product loops"
    spills = sorted(spill_ops(body) for body in loops)
    # No loop spills on Triton 3.6 (the version benchmarked). Triton 3.9's ptxas keeps one of
    # a thread's row offsets in local memory in the workers' loops of fp8 with a relu per
    # head at three consumers (a store and two loads a head of ~170 instructions).
    tight = dtype == torch.float8_e4m3fn and consumers == 3 and not linear
    newer = tuple(int(v) for v in triton.__version__.split(".")[:2]) > (3, 6)
    limit = 3 if tight and newer else 0
    assert spills[-1] <= limit, (
        f"spill loads/stores per product loop {spills} ({resources(kernel)})")
    for body in loops:
        ops = " ".join(body)
        # 64 x 128 accumulator elements over 128 threads: 64 a thread and head
        assert ops.count("FFMA") == 64
        assert ops.count("FMNMX") == (0 if linear else 64)


# The deepest q ring that ``supports`` allows, with paged kv (its rows' offsets take shared
# memory too): ``supports`` must count at least what the compiled kernel takes, or a launch
# would fail on the device.
@pytest.mark.compiled
@pytest.mark.parametrize("dtype,h,d,consumers", [
    (torch.float8_e4m3fn, 64, 128, 3), (torch.bfloat16, 16, 128, 2),
    (torch.float8_e4m3fn, 256, 64, 3)])
def test_hopper_supports_counts_the_kernels_shared_memory(dtype, h, d, consumers):
    from indexer import logits_hopper as hopper
    if not hopper.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    stages = max(st for st in range(2, 32)
                 if hopper.supports(dtype, h, d, hopper.HopperConfig(st, consumers)))
    kernel = compile_hopper_kernel(dtype, d, h, True, hopper.HopperConfig(stages, consumers))
    assert kernel.metadata.shared <= 227 * 1024, f"{stages} stages"
