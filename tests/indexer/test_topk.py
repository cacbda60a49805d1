"""top_k_per_row (indexer/topk.py): every path of the kernel (short, direct, sampled, radix,
refined, ties) against the exact set under the interpreter, long rows on a GPU, and the kernel
and the sweep's candidates compiled for sm_90 without spills (the default for sm_100 and GB10's
sm_121 too)."""

import dataclasses

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import TopkConfig, top_k_per_row
from indexer import reference as ref
from indexer import topk as topk_mod
from indexer.topk import (PATH_DIRECT, PATH_RADIX, PATH_REFINED, PATH_SAMPLED, PATH_SHORT,
                          PATH_TIES, default_config, scratch_elems)
from tests.support import indexer_gpu as gpu
from tests.support.aot import GPUS, compile_kernel, innermost_loops, resources, spill_ops


# --- under the interpreter -------------------------------------------------------------------

K = 32
CPU_CFG = default_config(K, "cpu")      # block 64, cand 128: short rows take every path


def ragged_rows(m, n, seed, lengths=None):
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(0, n + 1, (m,), generator=g)
    lengths = torch.as_tensor(lengths)
    ks = (torch.rand(m, generator=g) * (n - lengths + 1)).long().clamp(0, n).to(torch.int32)
    ke = (ks + lengths).clamp(max=n).to(torch.int32)
    return ks, ke


def exact_topk_sets(x, ks, ke, k):
    """Per row, the sorted indices (relative to ks) of the exact top-k: the kernel's total
    order is that of the float's order-preserving integer key (-0.0 below +0.0), ties
    going to the lowest index."""
    bits = x.contiguous().view(torch.int32)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    sets = []
    for i in range(x.shape[0]):
        a, b = int(ks[i]), int(ke[i])
        row = keys[i, a:b]
        order = torch.sort(row, descending=True, stable=True).indices[:k]
        sets.append(sorted(order.tolist()))
    return sets


def check_topk(x, ks, ke, k, **kw):
    out = torch.full((x.shape[0], k), -7, dtype=torch.int32)   # poison
    _, path = top_k_per_row(x, ks, ke, k, out, return_path=True, **kw)
    cks, cke = ks.clamp(0, x.shape[1]), ke.clamp(0, x.shape[1])
    valid = ref.topk_validity(x.double(), out, cks, cke, k)
    assert valid.all(), f"rows {torch.nonzero(~valid).flatten().tolist()} wrong"
    for i, want in enumerate(exact_topk_sets(x, cks, cke, k)):
        got = out[i].tolist()
        n_pad = k - len(want)
        assert sorted(v for v in got if v >= 0) == want, f"row {i}: not the exact set"
        assert got.count(-1) == n_pad, f"row {i}: padding"
    return out, path


@pytest.mark.interpreter
def test_topk_every_path_on_random_rows():
    lengths = [0, 1, K - 1, K, K + 1, 100, 128, 129, 200, 500, 700, 700, 650, 300, 2, 64]
    m, n = len(lengths), 700
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(21))
    ks, ke = ragged_rows(m, n, seed=22, lengths=lengths)
    _, path = check_topk(x, ks, ke, K)
    seen = set(path.tolist())
    assert {PATH_SHORT, PATH_DIRECT, PATH_SAMPLED} <= seen, seen
    direct_max = min(CPU_CFG.cand, 2 * CPU_CFG.runs * CPU_CFG.run)
    for i, length in enumerate(lengths):
        want = ({PATH_SHORT} if length <= K else {PATH_DIRECT} if length <= direct_max
                else {PATH_SAMPLED, PATH_RADIX})
        assert path[i].item() in want, (i, length, path[i].item())


@pytest.mark.interpreter
def test_topk_many_random_rows_and_strided_logits():
    m, n = 40, 600
    wide = torch.randn(m, n + 24, generator=torch.Generator().manual_seed(23)) * 50
    x = wide[:, 5:5 + n]                       # row stride n + 24, offset start
    ks, ke = ragged_rows(m, n, seed=24)
    check_topk(x, ks, ke, K)


@pytest.mark.interpreter
def test_topk_constant_and_few_valued_rows_take_the_tie_pass():
    m, n = 8, 400
    g = torch.Generator().manual_seed(25)
    x = torch.randint(0, 3, (m, n), generator=g).float()
    x[0] = 1.5                                 # a constant row
    x[1, :] = -2.0
    x[1, 7] = 5.0                              # one entry above a sea of ties
    ks = torch.zeros(m, dtype=torch.int32)
    ke = torch.full((m,), n, dtype=torch.int32)
    out, path = check_topk(x, ks, ke, K)
    # ~133 copies of the top value: more than a list of 128 holds, unless a row has few
    assert path[0] == path[1] == PATH_TIES and (path == PATH_TIES).sum() >= 5, path
    # ties go to the lowest indices
    assert sorted(out[0].tolist()) == list(range(K))
    assert sorted(out[1].tolist()) == sorted([7] + [i for i in range(K + 1) if i != 7][:K - 1])


@pytest.mark.interpreter
def test_topk_ties_at_the_threshold_inside_the_list_go_to_the_lowest_indices():
    # 50 values, each ~14 times: the threshold value has more copies than the top k takes,
    # but the threshold bin still fits the list, so the selection breaks the ties itself.
    m, n = 10, 700
    g = torch.Generator().manual_seed(30)
    x = torch.randint(0, 50, (m, n), generator=g).float() * 0.25 - 3.0
    ks, ke = ragged_rows(m, n, seed=31, lengths=[700, 650, 600, 300, 200, 129, 60, 50,
                                                 700, 690])
    _, path = check_topk(x, ks, ke, K)
    assert (path == PATH_RADIX).any() and (path == PATH_DIRECT).any(), path


@pytest.mark.interpreter
def test_topk_narrow_rows_refine_the_threshold_bin():
    # Long rows of distinct values: the small interpreter sample's window holds a tenth of
    # the row, so each of pass 1's bins across it holds more than `cand` (128) entries and
    # the pass runs again on the threshold bin.
    m, n = 4, 12000
    g = torch.Generator().manual_seed(32)
    base = torch.tensor(1.0).view(torch.int32).item()
    x = torch.stack([torch.randperm(n, generator=g) for _ in range(m)]).to(torch.int32)
    x = (x * (1 + torch.arange(m, dtype=torch.int32)[:, None]) + base).view(torch.float32)
    x[1] = -x[1]                               # negative keys: the general path
    ks = torch.zeros(m, dtype=torch.int32)
    ke = torch.full((m,), n, dtype=torch.int32)
    ke[2] = n - 5                              # masked edges
    ks[3] = 3
    # the interpreter's sample and list, in blocks big enough to keep the test quick
    cfg = TopkConfig(block=256, collect_block=128, cand=128, chunk=32, runs=8, run=4, z=3.0,
                     stages=1, num_warps=1, programs_per_sm=1)
    _, path = check_topk(x, ks, ke, K, config=cfg)
    assert (path == PATH_REFINED).all(), path


@pytest.mark.interpreter
def test_topk_a_window_that_misses_still_finds_the_threshold():
    # z = 0 and a tiny sample: the window often brackets the wrong ranks, the threshold
    # then lies in an open end bin and the passes narrow it from there.
    m, n = 16, 900
    g = torch.Generator().manual_seed(33)
    x = torch.randn(m, n, generator=g) * torch.logspace(-3, 3, m)[:, None]
    x[::3] = x[::3].abs()
    ks, ke = ragged_rows(m, n, seed=34, lengths=[n] * 8 + [700] * 8)
    cfg = TopkConfig(block=64, collect_block=32, cand=128, chunk=32, runs=2, run=2, z=0.0,
                     stages=1, num_warps=4, programs_per_sm=1)
    _, path = check_topk(x, ks, ke, K, config=cfg)
    assert (path == PATH_REFINED).any(), path


@pytest.mark.interpreter
@pytest.mark.parametrize("collect_block", [32, 64, 128])
def test_topk_pass_blocks_of_one_two_and_four_vectors_a_thread(collect_block):
    # With one warp a block of 32 vectors of 4 fills the threads once; 64 and 128 entries
    # give the pass-2 block two and four vectors a thread.
    m, n = 12, 1000
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(35))
    ks, ke = ragged_rows(m, n, seed=36)
    cfg = TopkConfig(block=128, collect_block=collect_block * 4, cand=256, chunk=64, runs=8,
                     run=4, z=3.0, stages=1, num_warps=1, programs_per_sm=1, sampled=False)
    _, path = check_topk(x, ks, ke, K, config=cfg)
    assert (path == PATH_RADIX).any(), path


@pytest.mark.interpreter
@pytest.mark.parametrize("sampled", [True, False])
def test_topk_negative_thresholds_compare_keys_positive_ones_bits(sampled):
    # Pass 1 and 2 compare raw float bits when the window lies above zero and the
    # order-preserving keys otherwise; both must give the same sets, collected by pass 1
    # (sampled) or by pass 2.
    m, n = 12, 800
    g = torch.Generator().manual_seed(37)
    x = torch.randn(m, n, generator=g)
    x[:4] -= 10.0                             # every entry negative
    x[4:8] *= 1e-30                           # tiny, both signs, threshold near zero
    x[8:] = x[8:].abs() + 1.0                 # every entry positive
    ks = torch.zeros(m, dtype=torch.int32)
    ke = torch.full((m,), n, dtype=torch.int32)
    cfg = dataclasses.replace(CPU_CFG, sampled=sampled)
    _, path = check_topk(x, ks, ke, K, config=cfg)
    if sampled:
        assert (path == PATH_SAMPLED).any(), path
        assert ((path == PATH_SAMPLED) | (path == PATH_RADIX)).all(), path
    else:
        assert (path == PATH_RADIX).all(), path


@pytest.mark.interpreter
def test_topk_sampled_pass_falls_back_to_pass_2_when_its_list_overflows():
    # z = 8 puts the window's floor so low that pass 1 collects more than the list holds:
    # the threshold bin still fits, so pass 2 collects it (two reads), with the same sets.
    m, n = 12, 900
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(40))
    x[:4] = x[:4].abs() * 1e3
    ks, ke = ragged_rows(m, n, seed=41, lengths=[n] * 6 + [700] * 6)
    _, low = check_topk(x, ks, ke, K, config=dataclasses.replace(CPU_CFG, z=8.0))
    _, usual = check_topk(x, ks, ke, K)
    assert (low == PATH_RADIX).sum() >= 9, low
    assert (usual == PATH_SAMPLED).sum() > (low == PATH_SAMPLED).sum(), (usual, low)


@pytest.mark.interpreter
def test_topk_gpu_defaults_on_long_rows():
    # The GPU's config (8-entry pass 2 blocks a thread, 16-entry pass 1 blocks, a
    # 1024-entry sample, k = 2048) interpreted on a few full-size rows of each kind.
    k, n = 2048, 65536
    g = torch.Generator().manual_seed(38)
    x = torch.randn(4, n, generator=g)
    x[1] = x[1] * 1e-3 - 5.0                   # negative threshold: the key path
    x[2, :30000] = 7.0                         # more ties at the threshold than fit
    x[3] = torch.randint(0, 2000, (n,), generator=g).float()   # ties inside the list
    ks = torch.tensor([0, 3, 0, 5], dtype=torch.int32)
    ke = torch.tensor([n, n - 7, n, 60000], dtype=torch.int32)
    _, path = check_topk(x, ks, ke, k, config=default_config(k, "cuda", (9, 0)))
    assert path.tolist() == [PATH_SAMPLED, PATH_SAMPLED, PATH_TIES, PATH_SAMPLED]


def signed_rows(n=300):
    """Rows of both zeros, both infinities and the float range's end, a row of -inf and one
    of zeros of alternating signs, with their (ks, ke)."""
    row = torch.linspace(-5, 5, n)
    row[::7] = -0.0
    row[3::11] = 0.0
    row[5] = float("inf")
    row[9] = float("-inf")
    row[17] = -3.4e38
    x = torch.stack([row, -row, row.flip(0), torch.full((n,), float("-inf")),
                     torch.where(torch.arange(n) % 2 == 0, 0.0, -0.0)])
    ks = torch.tensor([0, 10, 150, 0, 0], dtype=torch.int32)
    ke = torch.tensor([n, n - 10, n, n, n], dtype=torch.int32)
    return x, ks, ke


@pytest.mark.interpreter
def test_topk_signs_zeros_and_infinities():
    x, ks, ke = signed_rows()
    check_topk(x, ks, ke, K)
    check_topk(x, ks, ke, K, config=TopkConfig(block=64, collect_block=32, cand=64,
                                               chunk=32, runs=4, run=4, z=3.0, stages=1,
                                               num_warps=4, programs_per_sm=1))


@pytest.mark.interpreter
@pytest.mark.parametrize("k", [1, 20, 100])
def test_topk_k_not_a_power_of_two_or_tiny(k):
    m, n = 10, 300
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(27 + k))
    ks, ke = ragged_rows(m, n, seed=28)
    check_topk(x, ks, ke, k)


@pytest.mark.interpreter
def test_topk_clamps_ranges_to_the_row():
    m, n = 6, 150
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(29))
    ks = torch.tensor([-5, 0, 140, 200, 10, -3], dtype=torch.int32)
    ke = torch.tensor([40, 400, 9000, 300, 5, 2], dtype=torch.int32)
    got = top_k_per_row(x, ks, ke, K)
    cks, cke = ks.clamp(0, n), ke.clamp(0, n)
    assert torch.equal(got.sort(1).values,
                       top_k_per_row(x, cks.to(torch.int32), cke.to(torch.int32), K)
                       .sort(1).values)
    check_topk(x, ks, ke, K)


def draw_rows(data):
    """Hypothesis' rows: k, and [m, n] logits of few levels (ties) or of normal values at
    scales from 1e-20 to 1e20, with ranges that may leave the row."""
    k = data.draw(st.integers(1, 40), label="k")
    n = data.draw(st.integers(1, 900), label="n")
    m = data.draw(st.integers(1, 4), label="m")
    levels = data.draw(st.sampled_from([2, 7, 1000, 0]), label="levels")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    g = torch.Generator().manual_seed(seed)
    if levels:
        x = torch.randint(-levels, levels, (m, n), generator=g).float() / 3
    else:
        x = torch.randn(m, n, generator=g) * 10.0 ** torch.randint(-20, 20, (m, 1),
                                                                   generator=g)
    ks = torch.randint(-3, n + 1, (m,), generator=g, dtype=torch.int32)
    ke = torch.randint(-3, n + 4, (m,), generator=g, dtype=torch.int32)
    return k, x, ks, ke


@pytest.mark.interpreter
@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.data())
def test_topk_property_exact_set(data):
    k, x, ks, ke = draw_rows(data)
    cfg = data.draw(st.sampled_from([None, TopkConfig(
        block=64, collect_block=32, cand=max(64, 2 * triton.next_power_of_2(k)), chunk=32,
        runs=4, run=2, z=1.0, stages=1, num_warps=4, programs_per_sm=1)]), label="config")
    check_topk(x, ks, ke, k, config=cfg)


@pytest.mark.interpreter
def test_topk_rejects_bad_arguments():
    x = torch.randn(3, 50)
    ks = torch.zeros(3, dtype=torch.int32)
    ke = torch.full((3,), 50, dtype=torch.int32)
    with pytest.raises(ValueError, match="float32"):
        top_k_per_row(x.double(), ks, ke, 4)
    with pytest.raises(ValueError, match="unit column stride"):
        top_k_per_row(x.t().contiguous().t(), ks, ke, 4)
    with pytest.raises(ValueError, match="k must be >= 1"):
        top_k_per_row(x, ks, ke, 0)
    with pytest.raises(ValueError, match="ks must be contiguous int32"):
        top_k_per_row(x, ks.long(), ke, 4)
    with pytest.raises(ValueError, match=r"cand \(4\) must exceed k"):
        top_k_per_row(x, ks, ke, 4, config=TopkConfig(cand=4))
    with pytest.raises(ValueError, match="block must be a power of two"):
        top_k_per_row(x, ks, ke, 4, config=TopkConfig(block=1000))
    with pytest.raises(ValueError, match="collect_block"):
        top_k_per_row(x, ks, ke, 4, config=TopkConfig(collect_block=8192))
    with pytest.raises(ValueError, match="at least"):
        top_k_per_row(x, ks, ke, 4, scratch=torch.empty(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="8-byte aligned"):
        top_k_per_row(x, ks, ke, 4, scratch=torch.empty(10**6, dtype=torch.int32)[1:])
    with pytest.raises(ValueError, match="out must be int32"):
        top_k_per_row(x, ks, ke, 4, torch.empty(3, 5, dtype=torch.int32))


@pytest.mark.interpreter
def test_topk_scratch_does_not_depend_on_the_row_length():
    cfg = default_config(K, "cpu")
    need = scratch_elems(5, torch.device("cpu"), cfg)
    scratch = torch.empty(need, dtype=torch.int32)
    for n in (40, 900):
        x = torch.randn(5, n, generator=torch.Generator().manual_seed(n))
        ks = torch.zeros(5, dtype=torch.int32)
        ke = torch.full((5,), n, dtype=torch.int32)
        got = top_k_per_row(x, ks, ke, K, scratch=scratch)
        assert ref.topk_validity(x.double(), got, ks, ke, K).all()


# --- on a GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("sampled", [True, False])
def test_topk_long_rows_ties_and_paths(sampled):
    m, n = 2048, 65536
    g = gpu.gen(7)
    x = torch.randn(m, n, generator=g, device="cuda")
    ks, ke = gpu.ragged_rows(m, n, g)
    x[5] = 1.0                                                  # all ties
    x[6] = torch.randint(0, 4, (n,), generator=g, device="cuda").float()
    cfg = dataclasses.replace(topk_mod.default_config(gpu.K), sampled=sampled)
    out, path = top_k_per_row(x, ks, ke, gpu.K, config=cfg, return_path=True)
    valid = ref.topk_validity(x.double(), out, ks, ke, gpu.K)
    counts = topk_mod.path_counts(path)
    gpu.report(test="topk", sampled=sampled, M=m, N=n, valid_rows=int(valid.sum()), paths=counts)
    assert valid.all()
    assert path[5].item() == path[6].item() == topk_mod.PATH_TIES  # > cand ties at the threshold
    # one read for most rows with the sampled threshold, two without
    assert counts["sampled" if sampled else "radix"] > m // 2
    assert counts["refined"] <= 10, "pass 1 should rarely need a second read"


# --- compiled ahead of time ----------------------------------------------------------------------


def assert_row_passes_do_not_spill(kernel, cfg):
    """Pass 1's loops (bits or keys, and with ``sampled`` collecting or not: two or four) hold
    no spill loads or stores.
    Triton 3.6 keeps a value of pass 2's (which the sampled pass 1 leaves to ~0.1% of rows)
    in local memory, a store and a load a block, and a few more around the passes and in
    the selection, once a row or a chunk."""
    streaming = [body for body in innermost_loops(kernel) if any("LDGSTS" in op for op in body)]
    spills = sorted(spill_ops(body) for body in streaming)
    assert spills.count(0) >= (4 if cfg.sampled else 2) and spills[-1] <= 2, (
        f"{cfg}: spill loads/stores per row-pass loop {spills}")


def compile_topk(k, cfg, gpu=GPUS["sm_90"]):
    """The top-k kernel as top_k_per_row launches it over [4096, 65536] logits: its constexprs
    and the register cap that lets ``programs_per_sm`` programs share an SM."""
    fn = topk_mod._topk_kernel
    pointers = dict(p_x="fp32", p_ks="i32", p_ke="i32", p_out="i32", p_scratch="i64",
                    p_path="i8")
    constexprs = dict(topk_mod._launch_constants(cfg, k), WITH_PATH=False)
    options = {name: constexprs.pop(name) for name in ("num_warps", "maxnreg")}
    ints = dict(M=4096, N=65536, stride_xm=65536, stride_om=k)
    return compile_kernel(fn, pointers, ints, constexprs, gpu=gpu, **options)


def test_the_default_fits_each_familys_shared_memory():
    """Four programs an SM of four pipeline stages where the SM has 228 KiB (sm_90, sm_100),
    three stages where it has 100 (sm_120, GB10's sm_121, and the generic family's); the sweep
    starts from the device's default and times the other depth too."""
    for cap, stages in [((9, 0), 4), ((10, 0), 4), ((10, 3), 4), ((12, 0), 3), ((12, 1), 3),
                        ((8, 9), 3), ((8, 0), 3)]:
        cfg = default_config(2048, "cuda", cap)
        assert (cfg.stages, cfg.programs_per_sm) == (stages, 4), cap
        assert cfg == dataclasses.replace(default_config(2048, "cuda", (9, 0)), stages=stages)
        sweep = topk_mod.sweep_configs(2048, cap)
        assert sweep[0] == cfg and len(set(sweep)) == len(sweep)
        assert {c.stages for c in sweep} == {3, 4}


# The default on each family's GPU: sm_121 (GB10) and the generic family's sm_89 have 100 KiB
# of shared memory an SM, where four programs of four stages do not fit (default_config).
@pytest.mark.compiled
@pytest.mark.parametrize("name,k", [("sm_90", 2048), ("sm_90", 512), ("sm_100", 2048),
                                    ("sm_121", 2048), ("sm_89", 2048)])
def test_topk_kernel_compiles_without_spills_all_programs_resident(name, k):
    gpu = GPUS[name]
    cfg = topk_mod.default_config(k, capability=gpu.capability)
    kernel = compile_topk(k, cfg, gpu)
    use = resources(kernel)
    print(f"top-k {name} k={k} Triton {triton.__version__}: {use['REG']} registers a thread "
          f"(cap {topk_mod.max_registers(cfg)}), {kernel.metadata.shared} B shared, {cfg}")
    # every program of the persistent grid must be resident at once
    assert gpu.fits(kernel.metadata.shared, use["REG"], 32 * cfg.num_warps, cfg.programs_per_sm), (
        use, kernel.metadata.shared)
    assert "cp.async" in kernel.asm["ptx"], "expected the row passes' loads pipelined"
    assert_row_passes_do_not_spill(kernel, cfg)


@pytest.mark.compiled
@pytest.mark.parametrize("index", range(len(topk_mod.sweep_configs(2048, (9, 0)))))
def test_topk_sweep_candidates_compile_without_spills(index):
    cfg = topk_mod.sweep_configs(2048, (9, 0))[index]
    kernel = compile_topk(2048, cfg)
    use = resources(kernel)
    print(f"top-k sweep {index} Triton {triton.__version__}: {use['REG']} registers a thread "
          f"(cap {topk_mod.max_registers(cfg)}), {cfg}")
    assert_row_passes_do_not_spill(kernel, cfg)
