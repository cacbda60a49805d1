"""The prefill chunk planner: hand-made cases with their expected plans, and properties over
random batches (every query covered once, budgets kept except where documented, order kept,
groups packed greedily)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.planner import chunk_footprints, split_prefill_chunks, split_rows

BIG = 1 << 40


def plan(seqs, queries, workspace=BIG, budget=BIG, offset=0):
    return [((r.start, r.stop), (q.start, q.stop))
            for r, q in split_prefill_chunks(seqs, queries, workspace, budget, offset)]


# --- hand-made cases -------------------------------------------------------------------------

def test_empty_batch():
    assert plan([], []) == []


def test_everything_fits_in_one_piece():
    assert plan([10, 20, 30], [10, 20, 30]) == [((0, 3), (0, 60))]


def test_workspace_bounds_the_summed_kv():
    assert plan([10, 20, 30], [1, 2, 3], workspace=35) == [((0, 2), (0, 3)), ((2, 3), (0, 3))]
    assert plan([10, 20, 30], [1, 2, 3], workspace=60) == [((0, 3), (0, 6))]
    assert plan([10, 20, 30], [1, 2, 3], workspace=59) == [((0, 2), (0, 3)), ((2, 3), (0, 3))]


def test_logits_budget_packs_then_splits_queries():
    # 20 rows of 100 floats fit 8000 bytes: the request is cut every 20 queries.
    assert plan([100], [50], budget=100 * 20 * 4) == [
        ((0, 1), (0, 20)), ((0, 1), (20, 40)), ((0, 1), (40, 50))]
    # One byte short of 20 rows: 19-row pieces.
    assert plan([100], [50], budget=100 * 20 * 4 - 1)[0] == ((0, 1), (0, 19))


def test_small_requests_pack_until_the_logits_budget():
    # 4x4 = 16 floats, 8x8 = 64 fit 256 bytes; 108x108 does not: the big one is alone and,
    # since even one of its rows (100 floats) exceeds 64, goes one row per piece.
    got = plan([4, 4, 100], [4, 4, 100], budget=64 * 4)
    assert got[0] == ((0, 2), (0, 8))
    assert got[1:] == [((2, 3), (i, i + 1)) for i in range(100)]


def test_single_row_over_budget_is_its_own_piece():
    assert plan([1000], [3], budget=400) == [((0, 1), (0, 1)), ((0, 1), (1, 2)), ((0, 1), (2, 3))]
    assert plan([1000], [3], budget=0) == [((0, 1), (0, 1)), ((0, 1), (1, 2)), ((0, 1), (2, 3))]


def test_kv_larger_than_workspace_is_taken_alone():
    assert plan([5, 500, 5], [1, 1, 1], workspace=100) == [
        ((0, 1), (0, 1)), ((1, 2), (0, 1)), ((2, 3), (0, 1))]


def test_empty_requests_produce_no_piece():
    assert plan([0, 0], [0, 0]) == []
    assert plan([5, 0, 5], [5, 0, 5]) == [((0, 3), (0, 10))]
    # A kv-only request alone over the budget: a group without queries, no piece.
    assert plan([50, 10], [0, 10], budget=10 * 10 * 4) == [((1, 2), (0, 10))]


def test_queries_without_kv_form_one_piece():
    assert plan([0], [5], budget=4) == [((0, 1), (0, 5))]


def test_request_offset_shifts_request_slices_only():
    assert plan([100], [50], budget=100 * 20 * 4, offset=7) == [
        ((7, 8), (0, 20)), ((7, 8), (20, 40)), ((7, 8), (40, 50))]


def test_tensors_numpy_and_lists_agree():
    import numpy as np
    seqs, queries = [30, 40, 7, 0, 90], [3, 40, 7, 0, 12]
    want = plan(seqs, queries, workspace=100, budget=4000)
    assert plan(torch.tensor(seqs), torch.tensor(queries), 100, 4000) == want
    assert plan(np.array(seqs), np.array(queries), 100, 4000) == want


@pytest.mark.parametrize("seqs,queries", [([1, -1], [1, 1]), ([1, 1], [1, -2])])
def test_negative_lengths_raise(seqs, queries):
    with pytest.raises(ValueError, match="must be >= 0"):
        split_prefill_chunks(seqs, queries, 10, 10)


@pytest.mark.parametrize("workspace, budget", [(-1, 10), (10, -1), (-1, -1)])
def test_a_negative_workspace_or_budget_raises(workspace, budget):
    with pytest.raises(ValueError) as e:
        split_prefill_chunks([1, 2], [1, 1], workspace, budget)
    assert str(e.value) == "workspace_size and max_logits_bytes must be >= 0"
    assert split_prefill_chunks([1, 2], [1, 1], max(workspace, 0), max(budget, 0))  # zero is a budget


def test_footprints_of_a_plan_with_an_offset():
    seqs, queries = [30, 40, 7, 0, 90], [3, 40, 7, 0, 12]
    result = split_prefill_chunks(seqs, queries, 100, 4000, request_offset=5)
    assert chunk_footprints(result, seqs, 5) == [(3, 30), (25, 40), (15, 40), (7, 7), (11, 90), (1, 90)]


def test_errors_name_the_entry_and_the_default_offset_is_zero():
    with pytest.raises(ValueError) as e:
        split_prefill_chunks([1, -1], [1, 1], 10, 10)
    assert str(e.value) == "seq_lens[1] is -1; lengths must be >= 0"
    with pytest.raises(ValueError) as e:
        split_prefill_chunks([1, 1], [1, -2], 10, 10)
    assert str(e.value) == "query_lens[1] is -2; lengths must be >= 0"
    with pytest.raises(ValueError) as e:
        split_prefill_chunks([1, 2], [1], 10, 10)
    assert str(e.value) == "seq_lens has 2 entries but query_lens has 1"
    assert split_prefill_chunks([5], [5], 100, 1000) == [(slice(0, 1), slice(0, 5))]
    with pytest.raises(ValueError) as e:
        split_prefill_chunks([5], [5], 100, 1000, request_offset=1.5)
    assert str(e.value) == "request_offset must be an int, got 1.5"


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="entries"):
        split_prefill_chunks([1, 2], [1], 10, 10)


def test_split_rows():
    assert split_rows(slice(10, 20), width=8, max_bytes=4 * 8 * 3) == [
        slice(10, 13), slice(13, 16), slice(16, 19), slice(19, 20)]
    assert split_rows(slice(0, 2), width=1000, max_bytes=4) == [slice(0, 1), slice(1, 2)]
    assert split_rows(slice(5, 5), width=8, max_bytes=1000) == []


# --- properties ------------------------------------------------------------------------------

batches = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), max_size=24)


@settings(max_examples=400, deadline=None)
@given(batch=batches, workspace=st.integers(0, 3000), budget=st.integers(0, 600_000),
       offset=st.integers(0, 5))
def test_plan_properties(batch, workspace, budget, offset):
    queries = [q for q, _ in batch]
    seqs = [s for _, s in batch]
    result = split_prefill_chunks(seqs, queries, workspace, budget, offset)
    elems = budget // 4

    covered = []          # (request, query index within request), in plan order
    last = (-1, -1)
    groups = {}
    for requests, qs in result:
        a, b = requests.start - offset, requests.stop - offset
        assert 0 <= a < b <= len(batch) and qs.start < qs.stop
        # order kept: groups in request order, slices of a group consecutive from 0
        if (a, b) in groups:
            assert groups[(a, b)] == qs.start, "query slices of a group must be contiguous"
        else:
            assert a >= last[1], "groups must not overlap and must come in order"
            assert qs.start == 0
            last = (a, b)
        groups[(a, b)] = qs.stop
        # budgets, with the documented exceptions
        rows = qs.stop - qs.start
        width = sum(seqs[a:b])
        assert rows * width <= elems or rows == 1
        assert width <= workspace or b - a == 1
        if b - a > 1:
            assert sum(queries[a:b]) * width <= elems, "a packed group is never split"
        cu = 0
        for r in range(a, b):
            for j in range(queries[r]):
                if qs.start <= cu + j < qs.stop:
                    covered.append((r, j))
            cu += queries[r]
    for (a, b), stop in groups.items():
        assert stop == sum(queries[a:b]), "every query of a group is planned"
        if b < len(batch):
            # greedy: the next request would have broken a budget
            grown_w = sum(seqs[a:b + 1])
            assert grown_w > workspace or sum(queries[a:b + 1]) * grown_w > elems
    want = [(r, j) for r in range(len(batch)) for j in range(queries[r])]
    assert covered == want, "every query exactly once, in order"
    # each piece's footprint, counted apart from chunk_footprints: its rows are the queries it
    # covers (counted above, one by one), its width the kv of the requests of its group
    covered_rows = iter(covered)  # in plan order: each piece takes the next ones
    rows_of = [sum(1 for _ in zip(range(qs.stop - qs.start), covered_rows)) for _, qs in result]
    kv_start = [0]
    for kv in seqs:
        kv_start.append(kv_start[-1] + kv)
    want_footprints = [(rows_of[i], kv_start[r.stop - offset] - kv_start[r.start - offset])
                       for i, (r, _) in enumerate(result)]
    assert chunk_footprints(result, seqs, offset) == want_footprints


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 1000), n=st.integers(0, 500), width=st.integers(1, 5000),
       budget=st.integers(0, 100_000))
def test_split_rows_properties(start, n, width, budget):
    pieces = split_rows(slice(start, start + n), width, budget)
    rows = [r for p in pieces for r in range(p.start, p.stop)]
    assert rows == list(range(start, start + n))
    for p in pieces:
        assert (p.stop - p.start) * width * 4 <= budget or p.stop - p.start == 1
