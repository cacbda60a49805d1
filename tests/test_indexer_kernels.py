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

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from indexer import (LogitsConfig, PagedKV, PrefillStats, TopkConfig, kv_offsets,
                         mqa_logits, paged_mqa_logits, prefill_topk, row_stride_elems,
                         token_ranges, top_k_per_row)
    from indexer import reference as ref
    from indexer.topk import PATH_DIRECT, PATH_FALLBACK, PATH_SAMPLED, PATH_SHORT

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

    def ragged_rows(m, n, seed, lengths=None):
        g = torch.Generator().manual_seed(seed)
        if lengths is None:
            lengths = torch.randint(0, n + 1, (m,), generator=g)
        lengths = torch.as_tensor(lengths)
        ks = (torch.rand(m, generator=g) * (n - lengths + 1)).long().clamp(0, n).to(torch.int32)
        ke = (ks + lengths).clamp(max=n).to(torch.int32)
        return ks, ke

    def check_topk(x, ks, ke, k, **kw):
        out = torch.full((x.shape[0], k), -7, dtype=torch.int32)   # poison
        _, path = top_k_per_row(x, ks, ke, k, out, return_path=True, **kw)
        valid = ref.topk_validity(x.double(), out, ks, ke, k)
        assert valid.all(), f"rows {torch.nonzero(~valid).flatten().tolist()} wrong"
        return out, path

    def test_topk_every_path_on_random_rows():
        lengths = [0, 1, K - 1, K, K + 1, 100, 128, 129, 200, 500, 700, 700, 650, 300, 2, 64]
        m, n = len(lengths), 700
        x = torch.randn(m, n, generator=torch.Generator().manual_seed(21))
        ks, ke = ragged_rows(m, n, seed=22, lengths=lengths)
        _, path = check_topk(x, ks, ke, K)
        seen = set(path.tolist())
        assert {PATH_SHORT, PATH_DIRECT, PATH_SAMPLED} <= seen, seen

    def test_topk_many_random_rows_and_strided_logits():
        m, n = 40, 600
        wide = torch.randn(m, n + 24, generator=torch.Generator().manual_seed(23)) * 50
        x = wide[:, 5:5 + n]                       # row stride n + 24, offset start
        ks, ke = ragged_rows(m, n, seed=24)
        check_topk(x, ks, ke, K)

    def test_topk_heavy_ties_take_the_fallback_and_stay_exact():
        m, n = 8, 400
        g = torch.Generator().manual_seed(25)
        x = torch.randint(0, 3, (m, n), generator=g).float()
        x[0] = 1.5                                 # a constant row
        ks = torch.zeros(m, dtype=torch.int32)
        ke = torch.full((m,), n, dtype=torch.int32)
        out, path = check_topk(x, ks, ke, K)
        assert (path == PATH_FALLBACK).any()
        # ties go to the lowest indices
        assert sorted(out[0].tolist()) == list(range(K))

    def test_topk_signs_zeros_and_infinities():
        n = 300
        row = torch.linspace(-5, 5, n)
        row[::7] = -0.0
        row[3::11] = 0.0
        row[5] = float("inf")
        row[9] = float("-inf")
        row[17] = -3.4e38
        x = torch.stack([row, -row, row.flip(0)])
        ks = torch.tensor([0, 10, 150], dtype=torch.int32)
        ke = torch.tensor([n, 290, n], dtype=torch.int32)
        check_topk(x, ks, ke, K)

    def test_topk_narrow_bracket_forces_fallback_yet_exact():
        m, n = 12, 500
        x = torch.randn(m, n, generator=torch.Generator().manual_seed(26))
        ks = torch.zeros(m, dtype=torch.int32)
        ke = torch.full((m,), n, dtype=torch.int32)
        cfg = TopkConfig(block=64, cand=128, runs=16, run=4, z=0.0, num_warps=4)
        _, path = check_topk(x, ks, ke, K, config=cfg)
        assert (path == PATH_FALLBACK).any() and (path == PATH_SAMPLED).any()

    def test_topk_k_not_a_power_of_two():
        m, n, k = 10, 300, 20
        x = torch.randn(m, n, generator=torch.Generator().manual_seed(27))
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
        assert ref.topk_validity(x.double(), got, cks, cke, K).all()

    def test_topk_rejects_bad_arguments():
        x = torch.randn(3, 50)
        ks = torch.zeros(3, dtype=torch.int32)
        ke = torch.full((3,), 50, dtype=torch.int32)
        with pytest.raises(ValueError):
            top_k_per_row(x.double(), ks, ke, 4)
        with pytest.raises(ValueError):
            top_k_per_row(x, ks, ke, 4, config=TopkConfig(cand=4))
        with pytest.raises(ValueError):
            top_k_per_row(x, ks, ke, 4, scratch=torch.empty(1, dtype=torch.int32))

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
                torch.randn(nkv, d, generator=g), torch.rand(nkv, generator=g) + 0.5)

    def reference_topk(q, w, kv, kv_scale, query_lens, seq_lens, ratio, k):
        """Per request: float64 logits over its own kv, then the exact top-k check."""
        ks, ke = token_ranges(query_lens, seq_lens, ratio)
        t0 = c0 = 0
        pieces = []
        for ql, sl in zip(query_lens, seq_lens):
            rows, cols = slice(t0, t0 + ql), slice(c0, c0 + sl // ratio)
            pieces.append((rows, ref.logits(q[rows], kv[cols], kv_scale[cols], w[rows],
                                            ks[rows], ke[rows])))
            t0, c0 = t0 + ql, c0 + sl // ratio
        return ks, ke, pieces

    @pytest.mark.parametrize("ratio,budget", [(1, 4 * 64 * 60), (4, 4 * 8 * 40), (2, 1 << 30)])
    def test_prefill_dense_and_paged_match_reference(ratio, budget):
        query_lens = [40, 0, 3, 64, 9]
        seq_lens = [40, 12, 83, 200, 9]
        k = 16
        q, w, kv, kv_scale = batch(query_lens, seq_lens, ratio, 8, 32, seed=ratio)
        stats = PrefillStats()
        dense = prefill_topk(q, w, query_lens, seq_lens, kv=kv, kv_scale=kv_scale, k=k,
                             max_logits_bytes=budget, compress_ratio=ratio,
                             workspace=contextlib.nullcontext, stats=stats)
        ks, ke, pieces = reference_topk(q, w, kv, kv_scale, query_lens, seq_lens, ratio, k)
        for rows, want in pieces:
            valid = ref.topk_validity(want, dense[rows], ks[rows], ke[rows], k)
            assert valid.all()
        assert stats.pieces >= 1 and stats.logits_s > 0 and stats.topk_s > 0
        single_rows = [s for s in stats.piece_shapes if s[0] == 1]
        if not single_rows:
            assert stats.max_piece_bytes <= budget
        kv_lens = [s // ratio for s in seq_lens]
        cache, scale, table = make_paged(kv, kv_scale, kv_lens, page=8, seed=ratio)
        paged = prefill_topk(q, w, query_lens, seq_lens, paged=PagedKV(cache, scale, table),
                             k=k, max_logits_bytes=budget, compress_ratio=ratio,
                             workspace=contextlib.nullcontext)
        assert torch.equal(paged, dense)

    def test_prefill_takes_every_logits_buffer_inside_the_scope_and_within_budget():
        query_lens = [30, 50, 5]
        seq_lens = [30, 120, 60]
        budget = 4 * 24 * 40
        q, w, kv, kv_scale = batch(query_lens, seq_lens, 1, 8, 32, seed=31)
        rec = LogitsAllocations()
        stats = PrefillStats()
        with rec:
            prefill_topk(q, w, query_lens, seq_lens, kv=kv, kv_scale=kv_scale, k=8,
                         max_logits_bytes=budget, workspace=rec.scope, stats=stats)
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
        q, w, kv, kv_scale = batch(query_lens, seq_lens, 2, 16, 32, seed=41)
        kw = dict(kv=kv, kv_scale=kv_scale, k=8, compress_ratio=2,
                  workspace=contextlib.nullcontext)
        big = prefill_topk(q, w, query_lens, seq_lens, max_logits_bytes=1 << 30, **kw)
        small = prefill_topk(q, w, query_lens, seq_lens, max_logits_bytes=4 * 16 * 3, **kw)
        ks, ke, pieces = reference_topk(q, w, kv, kv_scale, query_lens, seq_lens, 2, 8)
        for rows, want in pieces:
            for got in (big, small):
                assert ref.topk_validity(want, got[rows], ks[rows], ke[rows], 8).all()

    def test_prefill_rejects_inconsistent_batches():
        q, w, kv, kv_scale = batch([4], [8], 1, 8, 32, seed=51)
        with pytest.raises(ValueError):
            prefill_topk(q, w, [4], [3], kv=kv, kv_scale=kv_scale, k=4)
        with pytest.raises(ValueError):
            prefill_topk(q, w, [4], [8], kv=kv[:5], kv_scale=kv_scale[:5], k=4)
        with pytest.raises(ValueError):
            prefill_topk(q, w, [4], [8], k=4)
