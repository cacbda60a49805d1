"""The Triton kernels and the prefill driver under the Triton interpreter, on the CPU, with
float32 inputs at small odd shapes, against the float64 reference.

How the interpreter gets switched on. ``@triton.jit`` decides between compiling and
interpreting when the module defining the kernel is imported (it reads TRITON_INTERPRET then).
Setting the variable inside a pytest process is therefore too late whenever anything imported
``indexer`` first — e.g. another test module collected before this one. So this module runs
itself in a child pytest whose environment has TRITON_INTERPRET=1 from the start: collected
normally it holds one test, which starts the child and shows its report on failure; in the
child it holds the real tests. To see them one by one:

    TRITON_INTERPRET=1 python -m pytest tests/test_indexer_kernels.py
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRETED:
    def test_kernels_under_the_triton_interpreter():
        root = Path(__file__).resolve().parents[1]
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))],
            cwd=root, env=env, capture_output=True, text=True, timeout=900)
        report = proc.stdout[-30000:] + proc.stderr[-5000:]
        assert proc.returncode == 0, report
        assert " passed" in proc.stdout, report

else:
    import contextlib
    import dataclasses

    import torch
    import triton
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from torch.utils._python_dispatch import TorchDispatchMode

    from indexer import (DenseKV, LogitsConfig, PagedKV, PrefillStats, TopkConfig, kv_offsets,
                         mqa_logits, paged_mqa_logits, prefill_topk, row_stride_elems,
                         token_ranges, top_k_per_row)
    from indexer import reference as ref
    from indexer.logits_hopper import HopperConfig
    from indexer.topk import (PATH_DIRECT, PATH_RADIX, PATH_REFINED, PATH_SAMPLED, PATH_SHORT,
                              PATH_TIES, default_config, scratch_elems)
    from indexer.weighted_q import FP8_MAX, split_weighted_q, w_tiles

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

    # --- logits ------------------------------------------------------------------------------

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

    def test_logits_defaults_allocate_an_aligned_output():
        args = make_inputs(7, 13, 8, 32, seed=12)
        out = mqa_logits(*args)
        assert out.shape == (7, 13) and out.stride(0) % 4 == 0
        assert rel_err(out, ref.logits(*args)) < FP32_TOL

    def test_logits_reject_misaligned_or_mismatched_arguments():
        q, kv, kv_scale, w, ks, ke = make_inputs(6, 10, 8, 32, seed=13)
        with pytest.raises(ValueError, match="16 bytes"):
            mqa_logits(q, kv, kv_scale, w, ks, ke, torch.empty(6, 13)[:, :10])
        with pytest.raises(ValueError, match="share a dtype"):
            mqa_logits(q, kv.double(), kv_scale, w, ks, ke)
        with pytest.raises(ValueError, match="int32"):
            mqa_logits(q, kv, kv_scale, w, ks.long(), ke)

    def test_logits_empty_shapes_launch_nothing():
        q, kv, kv_scale, w, ks, ke = make_inputs(4, 8, 8, 32, seed=14)
        assert mqa_logits(q[:0], kv, kv_scale, w[:0], ks[:0], ke[:0]).shape == (0, 8)
        zero = torch.zeros(4, dtype=torch.int32)
        assert mqa_logits(q, kv[:0], kv_scale[:0], w, zero, zero).shape == (4, 0)

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

    # --- top-k -------------------------------------------------------------------------------

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

    def test_topk_many_random_rows_and_strided_logits():
        m, n = 40, 600
        wide = torch.randn(m, n + 24, generator=torch.Generator().manual_seed(23)) * 50
        x = wide[:, 5:5 + n]                       # row stride n + 24, offset start
        ks, ke = ragged_rows(m, n, seed=24)
        check_topk(x, ks, ke, K)

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
        _, path = check_topk(x, ks, ke, k, config=default_config(k, "cuda"))
        assert path.tolist() == [PATH_SAMPLED, PATH_SAMPLED, PATH_TIES, PATH_SAMPLED]

    def test_topk_signs_zeros_and_infinities():
        n = 300
        row = torch.linspace(-5, 5, n)
        row[::7] = -0.0
        row[3::11] = 0.0
        row[5] = float("inf")
        row[9] = float("-inf")
        row[17] = -3.4e38
        x = torch.stack([row, -row, row.flip(0), torch.full((n,), float("-inf")),
                         torch.where(torch.arange(n) % 2 == 0, 0.0, -0.0)])
        ks = torch.tensor([0, 10, 150, 0, 0], dtype=torch.int32)
        ke = torch.tensor([n, 290, n, n, n], dtype=torch.int32)
        check_topk(x, ks, ke, K)
        check_topk(x, ks, ke, K, config=TopkConfig(block=64, collect_block=32, cand=64,
                                                   chunk=32, runs=4, run=4, z=3.0, stages=1,
                                                   num_warps=4, programs_per_sm=1))

    @pytest.mark.parametrize("k", [1, 20, 100])
    def test_topk_k_not_a_power_of_two_or_tiny(k):
        m, n = 10, 300
        x = torch.randn(m, n, generator=torch.Generator().manual_seed(27 + k))
        ks, ke = ragged_rows(m, n, seed=28)
        check_topk(x, ks, ke, k)

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

    @settings(max_examples=25, deadline=None, derandomize=True)
    @given(st.data())
    def test_topk_property_exact_set(data):
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
        cfg = data.draw(st.sampled_from([None, TopkConfig(
            block=64, collect_block=32, cand=max(64, 2 * triton.next_power_of_2(k)), chunk=32,
            runs=4, run=2, z=1.0, stages=1, num_warps=4, programs_per_sm=1)]), label="config")
        check_topk(x, ks, ke, k, config=cfg)

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

    # --- the prefill driver ------------------------------------------------------------------

    class LogitsAllocations(TorchDispatchMode):
        """Records every tensor allocated by indexer/prefill.py itself, and whether it was
        allocated inside the workspace scope."""

        def __init__(self):
            super().__init__()
            self.inside = False
            self.entered = 0
            self.records = []

        @contextlib.contextmanager
        def scope(self):
            self.entered += 1
            self.inside = True
            try:
                yield
            finally:
                self.inside = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided):
                frame = sys._getframe(1)
                while frame is not None and "torch" in frame.f_code.co_filename.split(os.sep):
                    frame = frame.f_back
                caller = frame.f_code.co_filename if frame else ""
                if caller.endswith(os.path.join("indexer", "prefill.py")):
                    self.records.append((tuple(result.shape), result.dtype, self.inside))
            return result

    def batch(query_lens, seq_lens, ratio, h, d, seed):
        g = torch.Generator().manual_seed(seed)
        t = sum(query_lens)
        nkv = sum(s // ratio for s in seq_lens)
        return (torch.randn(t, h, d, generator=g), torch.randn(t, h, generator=g),
                DenseKV(torch.randn(nkv, d, generator=g), torch.rand(nkv, generator=g) + 0.5))

    def paged_like(dense, query_lens, seq_lens, ratio, page, seed):
        """The same kv as ``dense``, scattered over the pages of a cache."""
        kv_lens = [s // ratio for s in seq_lens]
        return PagedKV(*make_paged(dense.kv, dense.scale, kv_lens, page=page, seed=seed))

    def reference_topk(q, w, dense, query_lens, seq_lens, ratio, k):
        """Per request: float64 logits over its own kv, then the exact top-k check."""
        ks, ke = token_ranges(query_lens, seq_lens, ratio)
        t0 = c0 = 0
        pieces = []
        for ql, sl in zip(query_lens, seq_lens):
            rows, cols = slice(t0, t0 + ql), slice(c0, c0 + sl // ratio)
            pieces.append((rows, ref.logits(q[rows], dense.kv[cols], dense.scale[cols], w[rows],
                                            ks[rows], ke[rows])))
            t0, c0 = t0 + ql, c0 + sl // ratio
        return ks, ke, pieces

    def run_prefill(q, w, query_lens, seq_lens, kv, **kw):
        return prefill_topk(q, w, query_lens, seq_lens, kv, workspace=contextlib.nullcontext,
                            **kw)

    @pytest.mark.parametrize("ratio,budget", [(1, 4 * 64 * 60), (4, 4 * 8 * 40), (2, 1 << 30)])
    def test_prefill_dense_and_paged_match_reference(ratio, budget):
        query_lens = [40, 0, 3, 64, 9]
        seq_lens = [40, 12, 83, 200, 9]
        k = 16
        q, w, dense = batch(query_lens, seq_lens, ratio, 8, 32, seed=ratio)
        stats = PrefillStats()
        got = run_prefill(q, w, query_lens, seq_lens, dense, k=k, max_logits_bytes=budget,
                          compress_ratio=ratio, stats=stats)
        ks, ke, pieces = reference_topk(q, w, dense, query_lens, seq_lens, ratio, k)
        for rows, want in pieces:
            valid = ref.topk_validity(want, got[rows], ks[rows], ke[rows], k)
            assert valid.all()
        assert stats.pieces >= 1 and stats.logits_s > 0 and stats.topk_s > 0
        single_rows = [s for s in stats.piece_shapes if s[0] == 1]
        if not single_rows:
            assert stats.max_piece_bytes <= budget
        paged = run_prefill(q, w, query_lens, seq_lens,
                            paged_like(dense, query_lens, seq_lens, ratio, page=8, seed=ratio),
                            k=k, max_logits_bytes=budget, compress_ratio=ratio)
        assert torch.equal(paged, got)

    @settings(max_examples=6, deadline=None, derandomize=True)
    @given(st.data())
    def test_prefill_equals_the_reference_on_random_batches(data):
        """Fresh random batches: the set of indices of every token is the float64 reference's
        top-k of its request, for a dense kv and the same kv paged."""
        r = data.draw(st.integers(1, 4), label="requests")
        query_lens = data.draw(st.lists(st.integers(0, 24), min_size=r, max_size=r), label="ql")
        seq_lens = [q + data.draw(st.integers(0, 90), label="past") for q in query_lens]
        ratio = data.draw(st.sampled_from([1, 2, 4]), label="ratio")
        k = data.draw(st.sampled_from([1, 7, 16]), label="k")
        budget = data.draw(st.sampled_from([4 * 16 * 12, 4 * 64 * 20, 1 << 30]), label="budget")
        page = data.draw(st.sampled_from([1, 4, 16]), label="page")
        seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
        q, w, dense = batch(query_lens, seq_lens, ratio, 8, 32, seed=seed)
        kw = dict(k=k, max_logits_bytes=budget, compress_ratio=ratio)
        got = run_prefill(q, w, query_lens, seq_lens, dense, **kw)
        ks, ke, pieces = reference_topk(q, w, dense, query_lens, seq_lens, ratio, k)
        for rows, logits in pieces:
            want = ref.topk(logits, ks[rows], ke[rows], k)
            assert torch.equal(got[rows].sort(1).values, want.sort(1).values)
        paged = paged_like(dense, query_lens, seq_lens, ratio, page, seed)
        assert torch.equal(run_prefill(q, w, query_lens, seq_lens, paged, **kw), got)

    def test_prefill_timed_and_untimed_give_the_same_indices_and_the_timer_sees_each_piece():
        query_lens, seq_lens = [20, 7, 33], [20, 50, 90]
        q, w, dense = batch(query_lens, seq_lens, 2, 8, 32, seed=61)
        kw = dict(k=8, max_logits_bytes=4 * 16 * 10, compress_ratio=2)
        plain = run_prefill(q, w, query_lens, seq_lens, dense, **kw)
        stats, seen = PrefillStats(), []
        timed = run_prefill(q, w, query_lens, seq_lens, dense, stats=stats,
                            on_piece=lambda piece, *_: seen.append(piece), **kw)
        assert torch.equal(timed, plain)
        assert stats.pieces == len(seen) > 3
        assert stats.piece_shapes == [(p.num_rows, p.width) for p in seen]
        assert stats.max_piece_bytes == max(p.num_rows * p.stride * 4 for p in seen)
        assert stats.logits_s > 0 and stats.topk_s > 0

    def test_prefill_calls_on_piece_once_per_piece_with_its_bounds_and_kernels():
        # request 1 has no kv (seq_len < ratio): its rows are -1 and belong to no piece
        query_lens, seq_lens = [30, 1, 12, 25], [30, 1, 70, 25]
        ratio, k, budget = 2, 8, 4 * 16 * 9
        q, w, dense = batch(query_lens, seq_lens, ratio, 8, 32, seed=71)
        for kv in (dense, paged_like(dense, query_lens, seq_lens, ratio, page=4, seed=72)):
            calls = []
            out = run_prefill(q, w, query_lens, seq_lens, kv, k=k, max_logits_bytes=budget,
                              compress_ratio=ratio, on_piece=lambda *call: calls.append(call))
            pieces = [piece for piece, _, _ in calls]
            # in order, disjoint, covering every token of a request with kv
            covered = [t for p in pieces for t in range(p.rows.start, p.rows.stop)]
            assert covered == [t for t in range(sum(query_lens)) if t != 30]
            assert (out[30] == -1).all()
            cu_kv = [0, 15, 15, 50, 62]
            for p in pieces:
                assert p.cols == slice(cu_kv[p.requests.start], cu_kv[p.requests.stop])
                assert p.stride == row_stride_elems(p.width) and p.num_rows >= 1
                assert p.num_rows == 1 or p.num_rows * p.stride * 4 <= budget
            # the callback's kernels rerun a piece on any view and write the same rows
            first = out.clone()
            out.fill_(7)
            for piece, logits, select in calls:
                buf, view = poisoned(piece.num_rows, piece.width)
                logits(out=view)
                select(view)
            assert torch.equal(out[covered], first[covered])

    def test_prefill_takes_every_logits_buffer_inside_the_scope_and_within_budget():
        query_lens = [30, 50, 5]
        seq_lens = [30, 120, 60]
        budget = 4 * 24 * 40
        q, w, dense = batch(query_lens, seq_lens, 1, 8, 32, seed=31)
        rec = LogitsAllocations()
        stats = PrefillStats()
        with rec:
            prefill_topk(q, w, query_lens, seq_lens, dense, k=8, max_logits_bytes=budget,
                         workspace=rec.scope, stats=stats)
        inside = [r for r in rec.records if r[2]]
        assert stats.pieces > 3
        assert rec.entered == stats.pieces == len(inside), rec.records
        for shape, dtype, _ in inside:
            assert dtype == torch.float32 and len(shape) == 2
            assert shape[0] * shape[1] * 4 <= budget
            assert shape[1] % 4 == 0
        outside_f32 = [r for r in rec.records if not r[2] and r[1] == torch.float32]
        assert outside_f32 == [], "no float32 buffer may be allocated outside the scope"

    def test_prefill_results_do_not_depend_on_the_budget():
        query_lens = [17, 33]
        seq_lens = [60, 33]
        q, w, dense = batch(query_lens, seq_lens, 2, 16, 32, seed=41)
        kw = dict(k=8, compress_ratio=2)
        big = run_prefill(q, w, query_lens, seq_lens, dense, max_logits_bytes=1 << 30, **kw)
        small = run_prefill(q, w, query_lens, seq_lens, dense, max_logits_bytes=4 * 16 * 3, **kw)
        ks, ke, pieces = reference_topk(q, w, dense, query_lens, seq_lens, 2, 8)
        for rows, want in pieces:
            for got in (big, small):
                assert ref.topk_validity(want, got[rows], ks[rows], ke[rows], 8).all()

    def one_line_error(kind, match, fn, *args, **kw):
        with pytest.raises(kind, match=match) as err:
            fn(*args, **kw)
        assert "\n" not in str(err.value)

    def test_dense_and_paged_kv_reject_bad_tensors_in_one_line():
        kv, scale = torch.randn(10, 32), torch.rand(10)
        one_line_error(ValueError, "DenseKV.kv has dtype torch.int32", DenseKV,
                       kv.to(torch.int32), scale)
        one_line_error(ValueError, r"DenseKV.kv must be \[N, D\]", DenseKV, kv[None], scale)
        one_line_error(ValueError, "contiguous rows", DenseKV, kv.t().contiguous().t(), scale)
        one_line_error(ValueError, r"DenseKV.scale must be float32 \[10\]", DenseKV, kv,
                       scale.double())
        one_line_error(ValueError, r"DenseKV.scale must be float32 \[10\]", DenseKV, kv, scale[:9])
        one_line_error(ValueError, "one device", DenseKV, kv, scale.to("meta"))
        one_line_error(TypeError, "DenseKV.scale must be a torch.Tensor", DenseKV, kv, [1.0] * 10)
        cache, pscale = torch.randn(6, 4, 32), torch.rand(6, 4)
        table = torch.zeros(2, 3, dtype=torch.int32)
        PagedKV(cache, pscale, table)
        one_line_error(ValueError, r"PagedKV.cache must be \[num_blocks, PAGE, D\]", PagedKV,
                       cache[0], pscale, table)
        one_line_error(ValueError, r"PagedKV.scale must be float32 \[6, 4\]", PagedKV, cache,
                       pscale[:, :3], table)
        one_line_error(ValueError, "PagedKV.block_table must be int32", PagedKV, cache, pscale,
                       table.long())
        one_line_error(ValueError, "one device", PagedKV, cache, pscale, table.to("meta"))

    def test_prefill_rejects_inconsistent_batches_in_one_line():
        q, w, dense = batch([4], [8], 1, 8, 32, seed=51)
        one_line_error(ValueError, "query_lens", prefill_topk, q, w, [4], [3], dense, k=4)
        one_line_error(ValueError, "DenseKV has 5 rows; the batch needs 8", prefill_topk, q, w,
                       [4], [8], DenseKV(dense.kv[:5], dense.scale[:5]), k=4)
        table = torch.zeros(2, 1, dtype=torch.int32)
        paged = PagedKV(torch.randn(3, 4, 32), torch.rand(3, 4), table)
        one_line_error(ValueError, "2 rows; the batch has 1 requests", prefill_topk, q, w,
                       [4], [8], paged, k=4)
        one_line_error(ValueError, "1 pages of 4 a request; a request of the batch has 8",
                       prefill_topk, q, w, [4], [8], PagedKV(paged.cache, paged.scale, table[:1]),
                       k=4)
        one_line_error(ValueError, "on meta but q on cpu", prefill_topk, q, w, [4], [8],
                       DenseKV(dense.kv.to("meta"), dense.scale.to("meta")), k=4)
        one_line_error(ValueError, r"out must be int32 \[4, 4\]", prefill_topk, q, w, [4], [8],
                       dense, k=4, out=torch.empty(4, 4, dtype=torch.int64))

    def test_prefill_names_the_kv_types_for_the_former_keywords():
        q, w, dense = batch([4], [8], 1, 8, 32, seed=52)
        one_line_error(TypeError, r"DenseKV\(kv, scale\) or PagedKV", prefill_topk, q, w, [4],
                       [8], dense.kv, k=4)
        one_line_error(TypeError, r"kv=DenseKV\(kv, kv_scale\)", prefill_topk, q, w, [4], [8],
                       kv=dense.kv, kv_scale=dense.scale, k=4)
        one_line_error(TypeError, "unexpected keyword argument 'budget'", prefill_topk, q, w,
                       [4], [8], dense, k=4, budget=1)

    # --- the weighted q in parts (the sm_90 kernel's linear half) -------------------------------

    @pytest.mark.parametrize("dtype,terms,bits", [(torch.float8_e4m3fn, 2, 3),
                                                  (torch.float8_e4m3fn, 3, 3),
                                                  (torch.bfloat16, 2, 7), (torch.bfloat16, 3, 7),
                                                  (torch.float16, 2, 10)])
    def test_weighted_q_parts_add_up_to_the_weighted_q(dtype, terms, bits):
        """row_scale * sum of the parts = sum_h w q_h, to what ``terms`` roundings to a
        ``bits``-bit mantissa leave, each within one unit in its last place (the interpreter's
        conversions round less carefully than the GPU's round-to-nearest, which halves each
        part's error; the GPU test holds the kernel to that)."""
        g = torch.Generator().manual_seed(terms)
        m, h, d = 37, 5, 32
        q = (torch.randn(m, h, d, generator=g) * 3).to(dtype)
        w = torch.randn(m, h, generator=g)
        w[3] = 0                                   # a row whose weighted q is zero
        parts, row_scale = split_weighted_q(q, w, terms)
        assert parts.dtype == dtype and parts.shape == (m, terms * d)
        want = (q.double() * w.double()[:, :, None]).sum(1)
        got = parts.double().view(m, terms, d).sum(1) * row_scale.double()[:, None]
        size = want.abs().amax(1)
        live = size > 0
        err = (got - want).abs().amax(1)[live] / size[live]
        assert err.max().item() <= 2.0 ** (-bits * terms) + 1e-6
        assert (parts[3].float() == 0).all() and row_scale[3].item() == 1.0
        if dtype == torch.float8_e4m3fn:
            # the scale puts each row's largest value at (or one step under) e4m3's maximum
            first = parts[:, :d].float().abs().amax(1)[live]
            assert ((first <= FP8_MAX) & (first >= 416)).all()
        elif dtype == torch.bfloat16:
            assert (row_scale == 1).all()

    def test_weighted_q_rejects_bad_inputs():
        q = torch.randn(4, 2, 32).bfloat16()
        with pytest.raises(ValueError, match="w must be float32"):
            split_weighted_q(q, torch.ones(4, 3), 2)
        with pytest.raises(ValueError, match="w must be float32"):
            split_weighted_q(q, torch.ones(4, 2, dtype=torch.float64), 2)
        with pytest.raises(ValueError, match="terms"):
            split_weighted_q(q, torch.ones(4, 2), 0)
        with pytest.raises(ValueError, match="contiguous last dimension"):
            split_weighted_q(q.transpose(1, 2), torch.ones(4, 32), 2)

    @pytest.mark.parametrize("m,scale", [(37, 0.5), (64, 1.0), (1, 0.5)])
    def test_w_tiles_transpose_scale_pad_and_interleave_rows(m, scale):
        h = 6
        wide = torch.randn(m, h + 3, generator=torch.Generator().manual_seed(m))
        w = wide[:, 2:2 + h]                       # strided rows
        wt = w_tiles(w, scale, 64)
        assert wt.shape == (h, 64)
        # within each 16 rows: 0, 8, 1, 9, ..., 7, 15; rows past M are zero
        place = [i // 16 * 16 + i % 8 * 2 + i % 16 // 8 for i in range(64)]
        assert sorted(place) == list(range(64))
        want = torch.zeros(h, 64)
        want[:, place[:m]] = w.t() * scale
        assert torch.equal(wt, want)
        with pytest.raises(ValueError, match="w must be float32"):
            w_tiles(w.double(), scale, 64)
        with pytest.raises(ValueError, match="block_m"):
            w_tiles(w, scale, 48)

    def test_hopper_config_checks_its_values():
        assert repr(HopperConfig(6, 3, 3)) == "wgmma 64x384 s6 linear3"
        assert HopperConfig(6, 3, 3) != HopperConfig(6, 3) and HopperConfig(6, 3).linear_terms == 0
        for bad in (dict(stages=1), dict(consumers=4), dict(linear_terms=5),
                    dict(linear_terms=-1)):
            with pytest.raises(ValueError, match="HopperConfig"):
                HopperConfig(**bad)
