"""fit's work is bounded by its limits, and its replayed peaks are right value by value."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arena_tools.fit import SEED, fit, logits_width, replay, seed_workload
from arena_tools.torch_model import CachingAllocatorModel, ModelOutOfMemory
from tests.support import ROOT

MiB = 1 << 20
BUDGET = SEED["budget_mb"] * MiB


def seed_fit(available: int = 1 << 50, **kw):
    return fit(SEED["max_model_len"], SEED["chunk_tokens"], SEED["compress_ratio"],
               SEED["budget_mb"], SEED["prompt_tokens"], available, **kw)


# -- the work a check does is bounded, not only its chunks -----------------------------------------
def test_a_plan_of_more_pieces_than_the_bound_is_refused_at_once():
    """64 million tokens in 3,200-token chunks is 20,000 chunks, within the chunk bound; a 62 MiB
    budget holds one 64,000,000-byte row at the end and 16 at the start: 41 million pieces in all,
    hours of replay. The check refuses it in one line naming the limit."""
    argv = ["--max-model-len", "64000000", "--prompt-tokens", "64000000", "--chunk-tokens", "3200",
            "--budget-mb", "62", "--available-mb", "8192", "--topk", "0"]
    code = f"import sys; from arena_tools.fit import main; sys.exit(main({argv!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and not proc.stdout, proc.stdout[-500:] + proc.stderr[-500:]
    [line] = proc.stderr.splitlines()
    assert "40,919,209 logits pieces, more than the 1,000,000 a fit check replays" in line, line


def test_the_piece_bound_is_exact(monkeypatch):
    import arena_tools.fit as fit_module
    pieces = sum(len(c.pieces) for c in seed_workload(254_000, 3_200, 4, BUDGET))
    assert fit_module.count_pieces(254_000, 3_200, 4, BUDGET) == pieces == 107
    monkeypatch.setattr(fit_module, "MAX_PIECES", pieces)
    assert len(seed_fit().rows) == 80
    monkeypatch.setattr(fit_module, "MAX_PIECES", pieces - 1)
    with pytest.raises(ValueError, match=r"invalid value 512 for 'budget_mb': the prefill cuts into 107 "
                                         r"logits pieces, more than the 106 a fit check replays"):
        seed_fit()


@settings(max_examples=60, deadline=None)
@given(prompt=st.integers(1, 40_000), chunk=st.integers(1, 20_000), ratio=st.integers(1, 8),
       budget=st.integers(1, 1 << 22))
def test_count_pieces_counts_what_the_workload_cuts(prompt, chunk, ratio, budget):
    from arena_tools.fit import count_pieces
    budget = max(budget, logits_width(prompt, ratio) * 4)
    assert count_pieces(prompt, chunk, ratio, budget) == sum(
        len(c.pieces) for c in seed_workload(prompt, chunk, ratio, budget))


# -- the peaks' values, against a second computation ------------------------------------------------
def independent_peaks(plans, capacity: int, retry: bool) -> list[int]:
    """Each chunk's peak reserved bytes for the logits pieces alone, without the model.

    One piece is live at a time and is freed before the next, so every segment is whole and free
    between pieces: a request takes the smallest cached segment of its pool (<= 1 MiB: the small
    pool) that holds it, else a new one of PyTorch's size (2 MiB small; 20 MiB under 10 MiB;
    else rounded up to 2 MiB). Past the capacity, with retry, every cached segment goes back and
    the request is tried once more (PyTorch's release_cached_blocks, all segments unsplit)."""
    segments: dict[bool, list[int]] = {True: [], False: []}
    peaks = []
    for plan in plans:
        peak = sum(map(sum, segments.values()))
        for rows in plan.pieces:
            size = max(512, -(-rows * plan.width * 4 // 512) * 512)
            small = size <= 1 << 20
            if any(s >= size for s in segments[small]):
                continue
            new = 2 << 20 if small else 20 << 20 if size < 10 << 20 else -(-size // (2 << 20)) * (2 << 20)
            if sum(map(sum, segments.values())) + new > capacity:
                if not retry:
                    raise MemoryError(plan.index)
                segments = {True: [], False: []}
                if new > capacity:
                    raise MemoryError(plan.index)
            segments[small].append(new)
            peak = max(peak, sum(map(sum, segments.values())))
        peaks.append(peak)
    return peaks


@settings(max_examples=80, deadline=None)
@given(prompt=st.integers(1, 300_000), chunk=st.integers(64, 20_000), ratio=st.integers(1, 8),
       budget_mb=st.integers(1, 600), capacity_mb=st.integers(1, 20_000), retry=st.booleans())
def test_replayed_peaks_equal_an_independent_computation(prompt, chunk, ratio, budget_mb, capacity_mb,
                                                          retry):
    budget = max(budget_mb * MiB, logits_width(prompt, ratio) * 4)
    if -(-prompt // chunk) > 2_000:
        chunk = -(-prompt // 2_000)
    plans = list(seed_workload(prompt, chunk, ratio, budget, topk=0))
    try:
        expected = independent_peaks(plans, capacity_mb * MiB, retry)
    except MemoryError as e:
        model = CachingAllocatorModel(capacity=capacity_mb * MiB, retry_on_oom=retry)
        with pytest.raises(ModelOutOfMemory) as failure:
            replay(model, plans, general=False)
        assert failure.value.chunk == e.args[0]
        return
    model = CachingAllocatorModel(capacity=capacity_mb * MiB, retry_on_oom=retry)
    assert replay(model, plans, general=False) == expected


def test_the_seed_peaks_on_a_discrete_gpu_of_1_gib():
    """The release-and-retry path's values, chunk by chunk (the count alone let a wrong peak pass)."""
    plans = list(seed_workload(254_000, 3_200, 4, BUDGET, topk=0))
    model = CachingAllocatorModel(capacity=1_024 * MiB, retry_on_oom=True)
    peaks = replay(model, plans, general=False)
    assert peaks == independent_peaks(plans, 1_024 * MiB, True)
    # By hand: chunk 1's 10,649,600 bytes round to a 12 MiB segment, chunk 2's 20,480,000 to 20 MiB,
    # chunk 3's 30,720,000 to 30 MiB; chunk 14 (142 MiB more than the 904 held) is the first to
    # release the cache, 15 releases in all; the end holds the 512 MiB segment and what fits beside.
    assert [p // MiB for p in peaks[:3]] == [12, 32, 62] and peaks[13] == 904 * MiB
    assert model.num_alloc_retries == 15 and peaks[-1] == 1_020 * MiB
