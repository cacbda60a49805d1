"""The caching-allocator model (arena_tools.torch_model) and the pre-launch fit check (arena_tools.fit)."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arena_tools.fit import SEED, Alloc, Free, fit, logits_width, main, replay, seed_workload
from arena_tools.torch_model import (LARGE_BUFFER, SMALL_SIZE, CachingAllocatorModel, ModelOutOfMemory,
                               allocation_size, round_size, roundup_power2_next_division)
from tests.support import ROOT

MiB = 1 << 20

# Measured on one H200, torch 2.11, seed workload, torch.cuda.memory_reserved (docs: GUIDE.md).
MEASURED_AT_166400 = 13_522 * MiB
MEASURED_END = 14_034 * MiB
MEASURED_SEGMENTS = 54
BUDGET = SEED["budget_mb"] * MiB
PLENTY = 1 << 50


def seed_fit(available: int = PLENTY, **kw):
    return fit(SEED["max_model_len"], SEED["chunk_tokens"], SEED["compress_ratio"],
               SEED["budget_mb"], SEED["prompt_tokens"], available, **kw)


# -- the model: fixed cases for each rule -----------------------------------------------------------
def test_rounding_follows_the_real_constants():
    assert [round_size(n) for n in (1, 511, 512, 513, 1025)] == [512, 512, 512, 1024, 1536]
    # roundup_power2_divisions: the example in PyTorch's comment (1200 in 4 steps -> 1280).
    assert roundup_power2_next_division(1200, 4) == 1280
    assert roundup_power2_next_division(4096, 4) == 4096
    assert round_size(5000, 4) == 5120  # steps of 1024 between 4096 and 8192
    assert round_size(1200, 4) == 1536  # at or below 512 * divisions: plain 512 rounding
    assert allocation_size(SMALL_SIZE) == 2 * MiB
    assert allocation_size(SMALL_SIZE + 512) == LARGE_BUFFER
    assert allocation_size(10 * MiB - 512) == LARGE_BUFFER
    assert allocation_size(10 * MiB) == 10 * MiB
    assert allocation_size(10 * MiB + 512) == 12 * MiB


def test_small_pool_packs_requests_into_2_mib_segments():
    m = CachingAllocatorModel()
    for _ in range(3):  # 3 x 600,000 rounded = 1,800,384 bytes: one 2 MiB segment
        m.malloc(600_000)
    assert (m.num_segments, m.reserved) == (1, 2 * MiB)
    m.malloc(600_000)
    assert (m.num_segments, m.reserved) == (2, 4 * MiB)
    m.check()


def test_large_pool_split_threshold_is_more_than_1_mib():
    m = CachingAllocatorModel()
    m.malloc(19 * MiB)  # a 20 MiB segment (19 MiB >= 10 MiB: rounded to 2 MiB); rest exactly 1 MiB
    assert (m.reserved, m.allocated) == (20 * MiB, 20 * MiB)  # not split: the block is whole
    m2 = CachingAllocatorModel()
    a = m2.malloc(5 * MiB)  # under 10 MiB: a 20 MiB segment, split, 15 MiB cached
    assert (m2.reserved, m2.allocated) == (20 * MiB, 5 * MiB)
    b = m2.malloc(5 * MiB)
    assert m2.num_segments == 1 and b == a + 5 * MiB
    m2.check()


def test_small_pool_splits_down_to_512_bytes():
    m = CachingAllocatorModel()
    m.malloc(2 * MiB - 1024)  # over 1 MiB: the large pool, a 20 MiB segment, whatever it fits
    assert m.reserved == LARGE_BUFFER
    s = CachingAllocatorModel()
    s.malloc(SMALL_SIZE)
    s.malloc(SMALL_SIZE - 512)
    s.malloc(512)  # the last 512 bytes of the first 2 MiB segment
    assert s.num_segments == 1 and s.allocated == 2 * MiB
    s.check()


def test_free_merges_neighbours_and_keeps_the_segment():
    m = CachingAllocatorModel()
    a, b, c = (m.malloc(5 * MiB) for _ in range(3))
    m.free(a)
    m.free(c)
    assert sorted(m.free_blocks()) == [(5 * MiB, False), (10 * MiB, False)]
    m.free(b)
    assert m.free_blocks() == [(20 * MiB, False)] and m.reserved == 20 * MiB
    m.check()


def test_growing_requests_keep_one_segment_per_size():
    m = CachingAllocatorModel()
    for i in range(1, 6):
        m.free(m.malloc(i * 11 * MiB))
    assert m.num_segments == 5 and m.reserved == (12 + 22 + 34 + 44 + 56) * MiB
    assert m.allocated == 0


def test_best_fit_takes_the_smallest_block_that_fits():
    m = CachingAllocatorModel()
    big, small = m.malloc(40 * MiB), m.malloc(30 * MiB)
    m.free(big)
    m.free(small)
    assert m.malloc(25 * MiB) == small


def test_zero_size_and_bad_frees():
    m = CachingAllocatorModel()
    assert m.malloc(0) == 0
    m.free(0)
    h = m.malloc(1000)
    m.free(h)
    with pytest.raises(ValueError, match="invalid device pointer"):
        m.free(h)
    with pytest.raises(ValueError, match="invalid device pointer"):
        m.free(12345)
    with pytest.raises(ValueError, match="size must be a non-negative int"):
        m.malloc(-1)


def test_oom_without_retry_fails_at_the_crossing():
    m = CachingAllocatorModel(capacity=30 * MiB, retry_on_oom=False)
    m.free(m.malloc(12 * MiB))
    with pytest.raises(ModelOutOfMemory, match=r"chunk 7: .*20\.00 MiB.*would hang") as e:
        m.malloc(20 * MiB, "chunk 7")
    assert (e.value.requested, e.value.reserved, e.value.capacity) == (20 * MiB, 12 * MiB, 30 * MiB)
    assert m.num_ooms == 1 and m.reserved == 12 * MiB


def test_oom_with_retry_releases_cached_unsplit_segments_like_pytorch():
    m = CachingAllocatorModel(capacity=30 * MiB)
    m.free(m.malloc(12 * MiB))
    m.malloc(20 * MiB)
    assert (m.reserved, m.num_segments, m.num_alloc_retries) == (20 * MiB, 1, 1)
    # A segment with a live block is split and cannot be released: still out of memory.
    held = CachingAllocatorModel(capacity=30 * MiB)
    held.malloc(5 * MiB)  # 20 MiB segment, 15 MiB of it cached but split
    with pytest.raises(ModelOutOfMemory, match="even after releasing"):
        held.malloc(16 * MiB)


def test_max_split_size_rules():
    m = CachingAllocatorModel(max_split_size=40 * MiB)
    m.free(m.malloc(50 * MiB))
    m.malloc(30 * MiB)  # an oversize cached block is not handed to a smaller request
    assert m.num_segments == 2
    n = CachingAllocatorModel(max_split_size=40 * MiB)
    n.free(n.malloc(50 * MiB))
    n.malloc(45 * MiB)  # within max_non_split_rounding (20 MiB): reused whole, no split
    assert (n.num_segments, n.allocated) == (1, 50 * MiB)
    o = CachingAllocatorModel(max_split_size=40 * MiB)
    o.free(o.malloc(100 * MiB))
    o.malloc(60 * MiB)  # 40 MiB of waste is too much: a new segment
    assert o.num_segments == 2
    # On a failed cudaMalloc, one oversize cached segment goes first, without the full retry.
    p = CachingAllocatorModel(capacity=100 * MiB, max_split_size=40 * MiB)
    p.free(p.malloc(60 * MiB))
    p.malloc(5 * MiB)  # refuses the oversize block: a 20 MiB segment, 80 MiB reserved
    p.malloc(30 * MiB)
    assert (p.reserved, p.num_device_free, p.num_alloc_retries) == (50 * MiB, 1, 0)
    p.check()


def test_empty_cache_returns_unsplit_free_segments_only():
    m = CachingAllocatorModel()
    m.malloc(5 * MiB)  # its 20 MiB segment stays split while the block lives
    m.free(m.malloc(30 * MiB))
    assert m.empty_cache() == 30 * MiB
    assert m.reserved == 20 * MiB
    m.check()


# -- the model: properties --------------------------------------------------------------------------
SIZES = st.one_of(st.integers(1, 2 * MiB), st.integers(1, 64 * MiB),
                  st.sampled_from([511, 512, 513, SMALL_SIZE, SMALL_SIZE + 1, 10 * MiB - 1,
                                   10 * MiB, 20 * MiB, 20 * MiB + 1]))
OPS = st.lists(st.one_of(st.tuples(st.just("malloc"), SIZES),
                         st.tuples(st.just("free"), st.integers(0, 1 << 16))), max_size=60)


def run_ops(m: CachingAllocatorModel, ops) -> list[int]:
    live: list[int] = []
    for op, arg in ops:
        if op == "malloc":
            live.append(m.malloc(arg))
        elif live:
            m.free(live.pop(arg % len(live)))
        m.check()
        assert m.reserved >= m.allocated >= 0
        assert m.peak >= m.reserved and m.peak_allocated >= m.allocated
    return live


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_reserved_never_below_allocated(ops):
    run_ops(CachingAllocatorModel(), ops)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_freeing_everything_keeps_the_cache(ops):
    m = CachingAllocatorModel()
    live = run_ops(m, ops)
    reserved, segments = m.reserved, m.num_segments
    for h in live:
        m.free(h)
    m.check()
    assert m.allocated == 0
    assert (m.reserved, m.num_segments) == (reserved, segments)
    # Every segment is whole again: one free block each.
    assert len(m.free_blocks()) == segments


@settings(max_examples=150, deadline=None)
@given(OPS, st.data())
def test_request_of_a_cached_blocks_size_reuses_it(ops, data):
    m = CachingAllocatorModel()
    run_ops(m, ops)
    # A request goes to the pool of its size: only a block of its own pool can serve it.
    candidates = [size for size, small in m.free_blocks() if (size <= SMALL_SIZE) == small]
    if not candidates:
        return
    size = data.draw(st.sampled_from(candidates))
    reserved, segments = m.reserved, m.num_segments
    m.malloc(size)
    assert (m.reserved, m.num_segments) == (reserved, segments)
    m.check()


# -- the workload -----------------------------------------------------------------------------------
def test_seed_workload_shape():
    chunks = list(seed_workload(SEED["prompt_tokens"], SEED["chunk_tokens"],
                                SEED["compress_ratio"], BUDGET))
    assert len(chunks) == 80 and chunks[-1].seen == 254_000 and chunks[-1].tokens == 1_200
    assert (chunks[0].width, chunks[51].width) == (832, 41_600)
    for c in chunks:
        assert c.width == logits_width(c.seen, 4) and sum(c.pieces) == c.tokens
        assert max(c.pieces) <= c.rows_per_piece == BUDGET // (c.width * 4)
        allocs = [e for e in c.events if isinstance(e, Alloc)]
        frees = [e.key for e in c.events if isinstance(e, Free)]
        assert sorted(a.key for a in allocs) == sorted(frees)  # nothing outlives its chunk
        assert all(a.nbytes <= BUDGET for a in allocs if a.workspace)
        assert {a.kind for a in allocs} == {"logits", "topk", "bounds"}
    # "chunk i wants about 10.24 MB x i until the 512 MiB cap" (width rounds up by < 64 columns).
    for c in chunks[:52]:
        assert len(c.pieces) == 1 and 0 <= c.piece_bytes - 10_240_000 * c.index < 3_200 * 64 * 4
    assert all(len(c.pieces) == 2 for c in chunks[52:79])
    no_topk = list(seed_workload(254_000, 3_200, 4, BUDGET, topk=0))
    assert all(e.kind != "topk" for c in no_topk for e in c.events if isinstance(e, Alloc))


# -- fit: the measured seed numbers -----------------------------------------------------------------
def test_seed_reproduces_the_h200_measurement_within_3_percent():
    report = seed_fit()
    at, end = report.row_at(166_400), report.rows[-1]
    assert at.chunk == 52
    assert abs(at.default_bytes - MEASURED_AT_166400) <= 0.03 * MEASURED_AT_166400
    assert abs(end.default_bytes - MEASURED_END) <= 0.03 * MEASURED_END
    assert report.default_peak == end.default_bytes
    # The arena: the budget from the first chunk on, plus the general path (bounds, top-k outputs).
    assert all(r.arena_bytes == report.arena_peak for r in report.rows)
    assert report.to_dict()["arena"]["workspace_bytes"] == 512 * MiB
    assert report.arena_peak - BUDGET == 28 * MiB  # 2 MiB small segment + one 26 MiB top-k segment


def test_seed_without_per_piece_topk_matches_memory_reserved_exactly():
    """Logits pieces plus the ks/ke bounds give memory_reserved to the MiB and the 54 segments:
    the measured run kept its top-k indices out of the caching allocator."""
    report = seed_fit(topk=0)
    assert report.row_at(166_400).default_bytes == MEASURED_AT_166400
    assert report.rows[-1].default_bytes == MEASURED_END
    assert report.rows[-1].default_segments == MEASURED_SEGMENTS
    assert report.arena_peak == BUDGET + 2 * MiB


# -- fit: the crossing, derived a second way --------------------------------------------------------
def closed_form_reserved(topk: int) -> list[int]:
    """memory_reserved after each seed chunk, by hand instead of by replaying the model.

    Uncapped chunk i (i <= 52) needs one new segment, its logits rounded up to 2 MiB, since
    every cached block is smaller. Chunk 53 is the first whose piece is capped by the budget:
    a 512 MiB segment that every later piece fits. The bounds take one 2 MiB small segment. With
    top-k outputs (26,214,400 bytes -> 26 MiB): a 26 MiB segment at chunk 1; chunk 2's logits
    (20,480,000 bytes) fit in it when it is free, so chunk 2 adds a second 26 MiB segment for its
    output instead of a 20 MiB one for its logits; afterwards every output fits a cached 26 MiB.
    """
    out, total = [], 2 * MiB
    for i in range(1, 81):
        seen = min(3_200 * i, 254_000)
        width = -(-(-(-seen // 4)) // 64) * 64
        logits = -(-3_200 * width * 4 // (2 * MiB)) * 2 * MiB
        if i <= 52:
            total += 26 * MiB if topk and i == 2 else logits
        elif i == 53:
            total += 512 * MiB
        if topk and i == 1:
            total += 26 * MiB
        out.append(total)
    return out


@pytest.mark.parametrize("topk", [0, 2048])
@pytest.mark.parametrize("available_mb", [40, 600, 1_024, 4_096, 8_192, 13_521, 13_522, 13_553,
                                          14_033, 14_034, 14_066, 20_000])
def test_first_crossing_chunk_matches_the_closed_form(available_mb, topk):
    available = available_mb * MiB
    expected = next((i for i, r in enumerate(closed_form_reserved(topk), 1) if r > available), None)
    report = seed_fit(available, topk=topk)
    assert report.default_crossing == expected
    assert report.fits == (expected is None)


def test_closed_form_agrees_with_every_row():
    for topk in (0, 2048):
        assert [r.default_bytes for r in seed_fit(topk=topk).rows] == closed_form_reserved(topk)


# -- replay: the default model fails where fit predicts ---------------------------------------------
@pytest.mark.parametrize("available_mb", [1_024, 8_192, 13_000])
def test_replay_with_a_capacity_fails_at_the_predicted_chunk(available_mb):
    available = available_mb * MiB
    predicted = seed_fit(available).default_crossing
    model = CachingAllocatorModel(capacity=available, retry_on_oom=False)
    with pytest.raises(ModelOutOfMemory, match=rf"chunk {predicted} \(") as e:
        replay(model, seed_workload(254_000, 3_200, 4, BUDGET))
    assert e.value.chunk == predicted
    assert model.reserved <= available


def test_on_a_discrete_gpu_the_release_and_retry_path_survives():
    """Where cudaMalloc fails cleanly, PyTorch frees its cache and retries: the same workload then
    completes in 1 GiB. Unified memory never gets there, which is why fit reports the crossing."""
    model = CachingAllocatorModel(capacity=1_024 * MiB, retry_on_oom=True)
    peaks = replay(model, seed_workload(254_000, 3_200, 4, BUDGET))
    assert len(peaks) == 80 and model.num_alloc_retries > 0 and model.peak <= 1_024 * MiB


# -- fit: arguments ---------------------------------------------------------------------------------
GOOD = dict(max_model_len=262_144, chunk_tokens=3_200, compress_ratio=4, budget_mb=512,
            prompt_tokens=254_000, available_bytes=8 << 30)


@pytest.mark.parametrize("change, pattern", [
    (dict(prompt_tokens=300_000),
     r"invalid value 300000 for 'prompt_tokens'.*no larger than max_model_len \(262,144\)"),
    (dict(prompt_tokens=0), r"invalid value 0 for 'prompt_tokens'.*positive number of tokens"),
    (dict(chunk_tokens=0), r"invalid value 0 for 'chunk_tokens'.*positive number of tokens"),
    (dict(chunk_tokens=3.5), r"invalid value 3\.5 for 'chunk_tokens': not an integer"),
    (dict(compress_ratio=0), r"invalid value 0 for 'compress_ratio'.*positive integer"),
    (dict(budget_mb=0), r"invalid value 0 for 'budget_mb'.*positive integer number of MiB"),
    (dict(budget_mb=True), r"invalid value True for 'budget_mb': not an integer"),
    (dict(max_model_len=-5), r"invalid value -5 for 'max_model_len'"),
    (dict(available_bytes=0), r"invalid value 0 for 'available_bytes'.*positive number of bytes"),
    (dict(max_model_len=40_000_000, prompt_tokens=40_000_000, compress_ratio=1, budget_mb=100),
     r"invalid value 100 for 'budget_mb': one row .* takes 160,000,000 bytes; accepted: at least "
     r"153 MiB"),
])
def test_fit_rejects_bad_arguments_by_name(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        fit(**{**GOOD, **change})


def test_fit_rejects_bad_keywords():
    with pytest.raises(ValueError, match=r"invalid value -1 for 'topk'"):
        fit(**GOOD, topk=-1)
    with pytest.raises(ValueError, match=r"'cuda' for 'allocator'.*'default' or 'arena'"):
        fit(**GOOD, allocator="cuda")
    with pytest.raises(ValueError, match=r"1000 for 'budget_bytes': one row"):
        seed_workload(254_000, 3_200, 4, 1000)


def test_available_memory_comes_from_hostmem_when_not_given(monkeypatch):
    fake = types.ModuleType("alloc.hostmem")
    fake.available_bytes = lambda: 20_000 * MiB
    monkeypatch.setitem(sys.modules, "alloc.hostmem", fake)
    report = fit(**{**GOOD, "available_bytes": None})
    assert report.available_bytes == 20_000 * MiB and "this machine" in report.available_source
    assert report.fits


def test_available_memory_of_this_machine(capsys):
    from alloc import hostmem  # part of the package: an import that fails is a failure, not a skip
    assert main(["--json"]) in (0, 1)
    data = json.loads(capsys.readouterr().out)
    memory = data["memory"]
    assert memory["device_source"] == "this machine's available host memory (no CUDA device)"
    # MemAvailable moves between two readings; the order of magnitude does not.
    assert 0.5 < memory["device_bytes"] / hostmem.available_bytes() < 2
    # vLLM's default utilization: the KV cache gets 0.9 of it less the 512 MiB of profiled logits
    assert data["available_bytes"] == memory["device_bytes"] - (int(memory["device_bytes"] * 0.9) - 512 * MiB)


def test_a_failing_hostmem_read_is_a_clear_error(monkeypatch, capsys):
    from alloc.errors import BackendError

    def broken() -> int:
        raise BackendError("cannot open /proc/meminfo")
    fake = types.ModuleType("alloc.hostmem")
    fake.available_bytes = broken
    monkeypatch.setitem(sys.modules, "alloc.hostmem", fake)
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "cannot open /proc/meminfo" in err and "--available-mb" in err


def test_missing_hostmem_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "alloc.hostmem", None)  # import of it raises ImportError
    with pytest.raises(RuntimeError, match="--available-mb"):
        fit(**{**GOOD, "available_bytes": None})
    assert main([]) == 2
    assert "--available-mb" in capsys.readouterr().err


# -- the command line -------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, code", [
    (["--available-mb", "20000"], 0),
    (["--available-mb", "8192"], 1),
    (["--available-mb", "8192", "--allocator", "arena"], 0),
    (["--available-mb", "500", "--allocator", "arena"], 1),
    (["--available-mb", "14034", "--topk", "0"], 0),
    (["--available-mb", "14033", "--topk", "0"], 1),
])
def test_exit_status_gates_a_launch(argv, code, capsys):
    assert main(argv) == code
    out = capsys.readouterr().out
    allocator = argv[argv.index("--allocator") + 1] if "--allocator" in argv else "default"
    verdict = "DOES NOT FIT" if code else "FITS"
    assert f"verdict for the {allocator} allocator: {verdict}\n" in out
    assert f"exit status {code}: the {allocator} allocator's verdict" in out


def test_table_names_the_crossing(capsys):
    assert main(["--available-mb", "8192"]) == 1
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if "default crosses" in l)
    assert line.split()[1] == "41" and "131,200" in line
    assert "first crosses the available memory at chunk 41 (131,200 tokens)" in out
    assert "14,066.0 MiB" in out


@pytest.mark.parametrize("argv, pattern", [
    (["--chunk-tokens", "0"], r"invalid value 0 for 'chunk_tokens'"),
    (["--prompt-tokens", "300000"], r"invalid value 300000 for 'prompt_tokens'.*max_model_len"),
    (["--available-mb", "-1"], r"--available-mb must be a positive number of MiB, got -1"),
    (["--budget-mb", "lots"], r"--budget-mb: invalid int value: 'lots'"),
    (["--budget-mb", "99999999999999"], r"--budget-mb 99999999999999: must be at most 4398046511104"),
    (["--allocator", "cuda"], r"invalid choice: 'cuda'"),
    (["--frobnicate"], r"unrecognized arguments: --frobnicate"),
])
def test_bad_arguments_exit_2(argv, pattern, capsys):
    if "--available-mb" not in argv:
        argv = argv + ["--available-mb", "8192"]  # so that nothing depends on this machine
    assert main(argv) == 2
    assert re.search(pattern, capsys.readouterr().err)


def test_a_plan_of_more_chunks_than_the_bound_is_refused_at_once(capsys):
    from arena_tools.fit import MAX_CHUNKS
    tokens = MAX_CHUNKS + 1  # one token per chunk: one chunk past the bound
    with pytest.raises(ValueError, match=rf"invalid value 1 for 'chunk_tokens': {MAX_CHUNKS + 1:,} chunks, more "
                                         rf"than the {MAX_CHUNKS:,} a fit check models; accepted: at least 2 tokens"):
        fit(**{**GOOD, "max_model_len": tokens, "prompt_tokens": tokens, "chunk_tokens": 1})
    assert len(fit(**{**GOOD, "max_model_len": tokens, "prompt_tokens": tokens - 1, "chunk_tokens": 1}).rows) \
        == MAX_CHUNKS
    capsys.readouterr()
    for prompt in (tokens, 10**8):  # the 10**8 tokens would have run for days
        assert main(["--max-model-len", str(prompt), "--prompt-tokens", str(prompt), "--chunk-tokens", "1",
                     "--available-mb", "8192", "--json"]) == 2
        out, err = capsys.readouterr()
        assert not out and len(err.splitlines()) == 1 and f"{prompt:,} chunks, more than the {MAX_CHUNKS:,}" in err


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "0 fits, 1 does not fit, 2 bad arguments" in " ".join(capsys.readouterr().out.split())


def test_json_parses_and_matches_the_report(capsys):
    assert main(["--available-mb", "8192", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    report = fit(254_000, 3_200, 4, 512, 254_000, 8_192 * MiB, max_num_seqs=256)
    assert data == json.loads(json.dumps(report.to_dict()))
    assert data["decode"]["piece_bytes"] == 256 * 254_000 * 4 and data["arena"]["fits"] is True
    assert data["fits"] is False and data["allocator"] == "default"
    assert data["default"]["first_crossing_chunk"] == 41
    assert data["default"]["first_crossing_tokens"] == 131_200
    assert data["arena"]["first_crossing_chunk"] is None
    assert data["chunks"][51]["tokens"] == 166_400
    assert data["chunks"][51]["default_bytes"] == report.row_at(166_400).default_bytes
    assert len(data["chunks"]) == 80


def png_chunks(blob: bytes) -> dict[bytes, list[bytes]]:
    assert blob[:8] == b"\x89PNG\r\n\x1a\n"
    chunks: dict[bytes, list[bytes]] = {}
    pos = 8
    while pos < len(blob):
        (length,) = struct.unpack(">I", blob[pos:pos + 4])
        kind = blob[pos + 4:pos + 8]
        chunks.setdefault(kind, []).append(blob[pos + 8:pos + 8 + length])
        pos += 12 + length
    assert pos == len(blob) and b"IEND" in chunks
    return chunks


def test_plot_writes_a_png_made_by_matplotlib(tmp_path, capsys):
    path = tmp_path / "fit.png"
    assert main(["--available-mb", "8192", "--json", "--plot", str(path)]) == 1
    captured = capsys.readouterr()
    json.loads(captured.out)  # the JSON on stdout stays clean
    assert f"plot written to {path}" in captured.err
    chunks = png_chunks(path.read_bytes())
    width, height = struct.unpack(">II", chunks[b"IHDR"][0][:8])
    assert (width, height) == (900, 500)
    text = dict(t.split(b"\0", 1) for t in chunks.get(b"tEXt", []))
    assert text[b"Software"].startswith(b"Matplotlib")
    assert text[b"Title"] == b"indexer-arena fit"


def test_plot_to_a_missing_directory_exits_2(tmp_path, capsys):
    assert main(["--available-mb", "8192", "--plot", str(tmp_path / "no" / "fit.png")]) == 2
    err = capsys.readouterr()
    assert "--plot" in err.err and "does not exist" in err.err and err.out == ""  # checked before the work


def test_the_budget_comes_from_the_configuration_unless_given(monkeypatch, capsys):
    monkeypatch.setenv("INDEXER_ARENA_CONF", "budget_mb:64")
    assert main(["--available-mb", "8192", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["budget_bytes"] == 64 << 20
    assert main(["--available-mb", "8192", "--json", "--budget-mb", "128"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["budget_bytes"] == 128 << 20
    monkeypatch.setenv("INDEXER_ARENA_CONF", "budget_mb:lots")
    assert main(["--available-mb", "8192"]) == 2
    assert "budget_mb" in capsys.readouterr().err


def test_main_through_python_c():
    code = ("import sys; from arena_tools.fit import main; "
            "sys.exit(main(['--available-mb', '8192', '--topk', '0']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "first crosses the available memory at chunk 41" in proc.stdout


def test_docstring_examples():
    import doctest

    import arena_tools.torch_model
    assert doctest.testmod(arena_tools.torch_model).failed == 0

