"""top_k_per_row's streaming layout (TopkConfig.stream, indexer/topk.py): every path against the
exact set under the interpreter, prefill and decode shapes on a GPU, and its kernels compiled for
sm_90 and sm_100."""

import dataclasses

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import TopkConfig, top_k_per_row
from indexer import reference as ref
from indexer import topk as topk_mod
from indexer.topk import PATH_TIES, default_config, scratch_elems
from tests.indexer.test_topk import CPU_CFG, K, check_topk, draw_rows, ragged_rows, signed_rows
from tests.support import indexer_gpu as gpu
from tests.support.aot import GPUS, compile_kernel, innermost_loops, resources, spill_ops


# --- the streaming layout (TopkConfig.stream), under the interpreter ---------------------------

# A list of 256 holds what lies above the interpreter sample's floor for most rows of 1,000.
STREAM_CFG = dataclasses.replace(CPU_CFG, stream=True, cand=256)


@pytest.mark.interpreter
def test_topk_stream_every_path_on_random_rows():
    lengths = [0, 1, K - 1, K, K + 1, 60, 64, 65, 129, 300, 700, 1000, 999, 513, 1000, 800]
    x = torch.randn(len(lengths), 1000, generator=torch.Generator().manual_seed(60))
    ks, ke = ragged_rows(len(lengths), 1000, seed=61, lengths=lengths)
    _, path = check_topk(x, ks, ke, K, config=STREAM_CFG)
    counts = topk_mod.path_counts(path)
    assert counts["short"] == 4 and counts["direct"] == 3, counts
    assert counts["stream"] >= 7, counts


@pytest.mark.interpreter
@pytest.mark.parametrize("z,cand,fallback", [(0.0, 256, "list below k"),
                                             (8.0, 64, "list overflows")])
def test_topk_stream_rows_whose_list_falls_short_or_overflows_take_the_other_paths(
        z, cand, fallback):
    # z = 0 puts the floor at the k-th largest's expected rank: about half the rows collect
    # fewer than k; z = 8 with a list of 64 collects more than it holds. Those rows go
    # through steps 4-7 (a second read) and must still give the exact sets.
    m, n = 10, 900
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(62))
    ks, ke = ragged_rows(m, n, seed=63, lengths=[n] * 5 + [700] * 5)
    cfg = dataclasses.replace(STREAM_CFG, z=z, cand=cand)
    _, path = check_topk(x, ks, ke, K, config=cfg)
    counts = topk_mod.path_counts(path)
    others = m - counts["stream"]
    assert others >= (2 if z == 0.0 else m), (fallback, counts)


@pytest.mark.interpreter
@pytest.mark.parametrize("segment", [64, 128, 512])
def test_topk_stream_segments_unaligned_starts_and_strided_logits(segment):
    # Segments start at the row's start rounded down to 16 entries: a row's first segment
    # has a masked head, its last a masked tail, and one segment may hold the whole row.
    m, n = 8, 1000
    base = torch.randn(m, n + 24, generator=torch.Generator().manual_seed(64 + segment))
    x = base[:, 5:n + 5]                                   # row stride n + 24, unaligned
    ks = torch.tensor([0, 1, 15, 16, 17, 333, 3, 100], dtype=torch.int32)
    ke = torch.tensor([n, n, 999, 801, 700, n, 70, 355], dtype=torch.int32)
    _, path = check_topk(x, ks, ke, K, config=dataclasses.replace(STREAM_CFG, segment=segment))
    assert (path == topk_mod.PATH_STREAM).sum() >= 5, path


@pytest.mark.interpreter
def test_topk_stream_ties_in_the_list_and_beyond_it():
    # Few-valued rows: the threshold value's copies sit in the list (the selection breaks
    # ties by index); a constant row collects far more than the list holds (the tie pass).
    m, n = 8, 700
    g = torch.Generator().manual_seed(66)
    x = torch.randint(0, 50, (m, n), generator=g).float() * 0.25 - 3.0
    x[0] = 1.5
    x[1] = -2.0
    x[1, 7] = 5.0
    ks, ke = ragged_rows(m, n, seed=67, lengths=[700, 700, 650, 600, 300, 200, 700, 690])
    out, path = check_topk(x, ks, ke, K, config=STREAM_CFG)
    assert path[0] == path[1] == PATH_TIES, path
    assert (path == topk_mod.PATH_STREAM).sum() >= 3, path
    assert sorted(out[0].tolist()) == list(range(K))


@pytest.mark.interpreter
def test_topk_stream_signs_zeros_infinities_and_negative_floors():
    n = 300
    x, ks, ke = signed_rows(n)
    g = torch.Generator().manual_seed(68)
    x = torch.cat([x, torch.stack([torch.randn(n, generator=g) - 10.0,
                                   torch.randn(n, generator=g) * 1e-30])])
    ks = torch.cat([ks, torch.tensor([0, 3], dtype=torch.int32)])
    ke = torch.cat([ke, torch.tensor([n, n], dtype=torch.int32)])
    _, path = check_topk(x, ks, ke, K, config=STREAM_CFG)
    assert path[5] == topk_mod.PATH_STREAM, path       # the floor below zero: keys compared


@pytest.mark.interpreter
def test_topk_stream_gpu_config_on_long_rows():
    # The GPU's blocks (16 entries a thread, a 2,048-entry sample, k = 2048), streamed in
    # 4,096-entry segments, interpreted on full-size rows: normal, negative, tied.
    k, n = 2048, 65536
    g = torch.Generator().manual_seed(69)
    x = torch.randn(3, n, generator=g)
    x[1] = x[1] * 1e-3 - 5.0
    x[2] = torch.randint(0, 2000, (n,), generator=g).float()
    ks = torch.tensor([0, 3, 5], dtype=torch.int32)
    ke = torch.tensor([n, n - 7, 60000], dtype=torch.int32)
    cfg = dataclasses.replace(default_config(k, "cuda", (9, 0)), stream=True)
    _, path = check_topk(x, ks, ke, k, config=cfg)
    assert path.tolist() == [topk_mod.PATH_STREAM] * 3


@pytest.mark.interpreter
@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.data())
def test_topk_stream_property_exact_set(data):
    k, x, ks, ke = draw_rows(data)
    kp = triton.next_power_of_2(k)
    cfg = data.draw(st.sampled_from([
        dataclasses.replace(default_config(k, "cpu"), stream=True),
        TopkConfig(block=64, collect_block=32, cand=max(64, 2 * kp), chunk=32, runs=4, run=2,
                   z=1.0, stages=1, num_warps=4, programs_per_sm=1, stream=True, segment=64)]),
        label="config")
    check_topk(x, ks, ke, k, config=cfg)


@pytest.mark.interpreter
def test_topk_stream_scratch_is_a_list_a_row_whatever_the_length():
    need = scratch_elems(5, torch.device("cpu"), STREAM_CFG)
    assert need == (3 * 5 + 1) // 2 * 2 + 2 * 5 + 5 * STREAM_CFG.cand * 2
    scratch = torch.empty(need, dtype=torch.int32)
    for n in (40, 900):
        x = torch.randn(5, n, generator=torch.Generator().manual_seed(n))
        ks = torch.zeros(5, dtype=torch.int32)
        ke = torch.full((5,), n, dtype=torch.int32)
        got = top_k_per_row(x, ks, ke, K, scratch=scratch, config=STREAM_CFG)
        assert ref.topk_validity(x.double(), got, ks, ke, K).all()
    with pytest.raises(ValueError, match="at least"):
        top_k_per_row(x, ks, ke, K, scratch=scratch[:-2], config=STREAM_CFG)
    with pytest.raises(ValueError, match="segment"):
        top_k_per_row(x, ks, ke, K, config=dataclasses.replace(STREAM_CFG, segment=100))


# --- on a GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("m,n", [(2048, 65536), (64, 131072), (8, 131072)])
def test_topk_stream_long_rows_and_decode_shapes(m, n):
    # The streaming layout at prefill and decode shapes: ragged rows (full, causal, random
    # ranges, shorter than k, empty), an all-ties row and a four-valued one, against the
    # float64 reference (ties valid); most rows read once (PATH_STREAM).
    g = gpu.gen(11)
    x = torch.randn(m, n, generator=g, device="cuda")
    ks, ke = gpu.ragged_rows(m, n, g)
    x[5 % m] = 1.0
    x[6 % m] = torch.randint(0, 4, (n,), generator=g, device="cuda").float()
    cfg = dataclasses.replace(topk_mod.default_config(gpu.K), stream=True)
    out, path = top_k_per_row(x, ks, ke, gpu.K, config=cfg, return_path=True)
    valid = ref.topk_validity(x.double(), out, ks, ke, gpu.K)
    counts = topk_mod.path_counts(path)
    gpu.report(test="topk_stream", M=m, N=n, valid_rows=int(valid.sum()), paths=counts)
    assert valid.all()
    if m > 6:
        assert path[5].item() == path[6].item() == topk_mod.PATH_TIES
    long_rows = int(((ke - ks) > cfg.runs * cfg.run * 2).sum())
    assert counts["stream"] >= long_rows - max(2, long_rows // 100), counts
    again = top_k_per_row(x, ks, ke, gpu.K, config=cfg)      # the counters start from 0
    assert torch.equal(again.sort(1).values, out.sort(1).values)


# --- compiled ahead of time ------------------------------------------------------------------

@pytest.mark.compiled
@pytest.mark.parametrize("name", ["sm_90"])
def test_topk_stream_kernels_compile_without_spills_in_the_stream(name):
    """The streaming kernel as top_k_per_row launches it over [4096, 65536] logits: its
    segment loop pipelined (cp.async) without spills, all ``programs_per_sm`` programs
    resident; and the sample kernel."""
    gpu_ = GPUS[name]
    cfg = dataclasses.replace(topk_mod.default_config(2048, capability=gpu_.capability),
                              stream=True)
    constexprs = dict(topk_mod._launch_constants(cfg, 2048), WITH_PATH=False)
    options = {key: constexprs.pop(key) for key in ("num_warps", "maxnreg")}
    pointers = dict(p_x="fp32", p_ks="i32", p_ke="i32", p_out="i32", p_lo="i32", p_hi="i32",
                    p_done="i32", p_cnt="i64", p_lists="i64", p_path="i8")
    ints = dict(N=65536, SEG=65536, n_seg=2, stride_xm=65536, stride_om=2048)
    kernel = compile_kernel(topk_mod._stream_kernel, pointers, ints, constexprs, gpu=gpu_,
                            **options)
    use = resources(kernel)
    print(f"top-k stream {name} Triton {triton.__version__}: {use['REG']} registers a thread "
          f"(cap {topk_mod.max_registers(cfg)}), {kernel.metadata.shared} B shared")
    assert gpu_.fits(kernel.metadata.shared, use["REG"], 32 * cfg.num_warps,
                     cfg.programs_per_sm), (use, kernel.metadata.shared)
    assert "cp.async" in kernel.asm["ptx"]
    streaming = [body for body in innermost_loops(kernel) if any("LDGSTS" in op for op in body)]
    assert streaming and min(spill_ops(body) for body in streaming) == 0, (
        [spill_ops(body) for body in streaming])
    setup = compile_kernel(
        topk_mod._stream_setup_kernel,
        dict(p_x="fp32", p_ks="i32", p_ke="i32", p_lo="i32", p_hi="i32", p_done="i32",
             p_cnt="i64"),
        dict(N=65536, stride_xm=65536),
        dict(K=2048, CAND=cfg.cand, RUNS=cfg.runs, RUN=cfg.run, Z=cfg.z), gpu=gpu_,
        num_warps=cfg.num_warps)
    assert resources(setup)["REG"] > 0
