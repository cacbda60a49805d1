"""prefill_topk (indexer/prefill.py): the driver's indices against the float64 reference per
request, dense and paged, timed or not, on any budget, its buffers inside the workspace scope,
and its one-line refusals, under the interpreter; on a GPU at real shapes, and with and without
the arena allocator (a child process started from this file installs it first)."""

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from indexer import (DenseKV, PagedKV, PrefillStats, mqa_logits, prefill_topk, row_stride_elems,
                     token_ranges, top_k_per_row)
from indexer import reference as ref
from indexer.topk import default_config as topk_default_config
from tests.support import ROOT
from tests.support import indexer_gpu as gpu
from tests.support.indexer_cpu import make_paged, poisoned


# --- under the interpreter -------------------------------------------------------------------


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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
def test_prefill_with_the_streaming_top_k_gives_the_reference_sets():
    # TopkConfig.stream through the driver: its scratch (a list a row of the tallest piece)
    # sized once for every piece, the rows long enough to stream streamed, the same sets.
    query_lens, seq_lens, k = [40, 3, 64, 9], [40, 83, 200, 9], 16
    q, w, dense = batch(query_lens, seq_lens, 1, 8, 32, seed=5)
    cfg = dataclasses.replace(topk_default_config(k, "cpu"), stream=True)
    kw = dict(k=k, max_logits_bytes=4 * 64 * 60, compress_ratio=1)
    got = run_prefill(q, w, query_lens, seq_lens, dense, topk_config=cfg, **kw)
    ks, ke, pieces = reference_topk(q, w, dense, query_lens, seq_lens, 1, k)
    for rows, want in pieces:
        assert ref.topk_validity(want, got[rows], ks[rows], ke[rows], k).all()
    plain = run_prefill(q, w, query_lens, seq_lens, dense, **kw)
    assert torch.equal(got.sort(1).values, plain.sort(1).values)


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
def test_prefill_names_the_kv_types_for_the_former_keywords():
    q, w, dense = batch([4], [8], 1, 8, 32, seed=52)
    one_line_error(TypeError, r"DenseKV\(kv, scale\) or PagedKV", prefill_topk, q, w, [4],
                   [8], dense.kv, k=4)
    one_line_error(TypeError, r"kv=DenseKV\(kv, kv_scale\)", prefill_topk, q, w, [4], [8],
                   kv=dense.kv, kv_scale=dense.scale, k=4)
    one_line_error(TypeError, "unexpected keyword argument 'budget'", prefill_topk, q, w,
                   [4], [8], dense, k=4, budget=1)


# --- on a GPU --------------------------------------------------------------------------------

QUERY_LENS = [2048, 100, 3000]
SEQ_LENS = [16384, 100, 12000]
RATIO = 4
BUDGET = 16 << 20


def driver_batch(seed=21):
    g = gpu.gen(seed)
    t = sum(QUERY_LENS)
    nkv = sum(s // RATIO for s in SEQ_LENS)
    q, kv, row_scale = gpu.quantize(torch.randn(t, 64, 128, generator=g, device="cuda"),
                                    torch.randn(nkv, 128, generator=g, device="cuda"), gpu.FP8)
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
    return prefill_topk(q, w, QUERY_LENS, SEQ_LENS, DenseKV(kv, kv_scale), k=gpu.K,
                        max_logits_bytes=BUDGET, compress_ratio=RATIO, stats=stats,
                        workspace=scope)


@pytest.mark.gpu
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
        want = top_k_per_row(whole, ks[rows], ke[rows], gpu.K)
        # the same set per row; the order inside a row depends on which path a row took
        assert torch.equal(got[rows].sort(1).values, want.sort(1).values)
        exact = ref.logits(q[rows], kv[cols], kv_scale[cols], w[rows], ks[rows], ke[rows])
        agreements.append(ref.topk_agreement(exact, got[rows], ks[rows], ke[rows], gpu.K))
        t0, c0 = t0 + ql, c0 + sl // RATIO
    agree = torch.cat(agreements)
    # the paged driver on the same kv, scattered over a cache: the same indices
    kv_lens = [s // RATIO for s in SEQ_LENS]
    cache, scale, table = gpu.make_paged(kv, kv_scale, kv_lens, 64, gpu.gen(22))
    scope = None if alloc_available() else contextlib.nullcontext
    paged = prefill_topk(q, w, QUERY_LENS, SEQ_LENS, PagedKV(cache, scale, table), k=gpu.K,
                         max_logits_bytes=BUDGET, compress_ratio=RATIO, workspace=scope)
    assert torch.equal(paged, got)
    gpu.report(test="driver", pieces=stats.pieces, max_piece_bytes=stats.max_piece_bytes,
               budget=BUDGET, agree_exact_mean=agree.mean().item(), agree_exact_min=agree.min().item())
    assert stats.pieces > 3 and stats.max_piece_bytes <= BUDGET
    assert agree.mean().item() >= gpu.EXACT_AGREE[gpu.FP8][0]


@pytest.mark.gpu
@pytest.mark.parametrize("scope", ["process", "workspace"])
def test_prefill_same_indices_with_and_without_the_arena(tmp_path, scope):
    if not alloc_available():
        pytest.skip("the alloc extension is not built")
    plain = run_driver().cpu()
    out = tmp_path / "arena.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("INDEXER_ARENA_CONF", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--arena-child",
                           str(out), scope], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    gpu.report(test="arena", **child)
    assert child["scope"] == scope
    if scope == "process":
        assert child["workspace_requests"] == child["pieces"], "every logits buffer from the arena"
        assert child["max_piece_bytes"] <= child["workspace_peak"] <= 64 << 20
    else:  # PyTorch's pool splits every piece out of the one segment the arena gave it
        # (and, for pieces of 1 MiB or less, the one small-block segment beside it)
        assert child["pool_segments"] in ([64 << 20], [64 << 20, 2 << 20]), child
        assert child["workspace_requests"] == len(child["pool_segments"])
    assert torch.equal(torch.load(out), plain)


# --- the arena child -------------------------------------------------------------------------


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
