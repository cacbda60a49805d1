"""Mapping arenas on the CPU: one address range reserved once, pages mapped as blocks need them and
unmapped by release_cached. The host backend simulates a device's page mapping (the range is
reserved inaccessible, a mapped page is read-write and zero-filled, an unmapped one is discarded)
and counts every map and unmap, and every call the CUDA driver would refuse, so these tests see
exactly what the arena asks of a mapping backend. The plugin's mapped general pools are tested in
plugin/test_mapped_pools.py."""

import ctypes

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from alloc import Arena, ArenaOutOfMemory, HostGuard
from alloc._lib import ffi, lib

MiB = 1 << 20
PAGE = 64 << 10


def mapped(page=PAGE, address_range=256 * MiB, **kw):
    kw.setdefault("alignment", 512)
    return Arena(0, growable=True, address_range=address_range, page_size=page, **kw)


def consistent(a):
    """What every state must show: the invariant walk holds, the arena's capacity is what the
    backend has mapped, every live block's pages are mapped, and no call broke the driver's rules."""
    a.check()
    s, c = a.stats(), a.mapping_counters()
    assert s["capacity"] == c["mapped"] == sum(r.size for r in a.regions())
    assert c["errors"] == 0 and c["ranges"] == 1 and c["range_reserves"] == 1
    rng = a.address_range()
    for b in a.blocks():
        assert rng.base <= b.address and b.address + b.size <= rng.base + rng.size
        if b.state == "used":
            assert a.range_mapped(b.address, b.size)
    for r in a.regions():
        assert r.base % a.page_size == 0 and r.size % a.page_size == 0
    return s, c


def pages_touched(a):
    """Pages that some live block touches: what must stay mapped."""
    pages = set()
    for b in a.blocks():
        if b.state == "used":
            pages.update(range(b.address // a.page_size, (b.address + b.size - 1) // a.page_size + 1))
    return pages


def fill(address, size, seed):
    ctypes.memmove(address, bytes([(address >> 9 ^ seed) & 0xFF]) * size, size)


def intact(address, size, seed):
    return ctypes.string_at(address, size) == bytes([(address >> 9 ^ seed) & 0xFF]) * size


def test_pages_are_mapped_as_blocks_need_them_and_growth_continues_the_free_tail():
    with mapped() as a:
        rng = a.address_range()
        assert a.page_size == PAGE and rng.size == 256 * MiB and a.regions() == []
        s, c = consistent(a)
        assert s["capacity"] == 0 and c["maps"] == 0
        first = a.allocate(1)
        assert first == rng.base
        s, c = consistent(a)
        assert s["capacity"] == PAGE and c["maps"] == 1 and s["regions"] == 1
        rest = [a.allocate(512) for _ in range(PAGE // 512 - 1)]  # the rest of the first page
        assert consistent(a)[1]["maps"] == 1
        a.allocate(512)                                             # one byte past it: one more page
        s, c = consistent(a)
        assert c["maps"] == 2 and s["capacity"] == 2 * PAGE and s["regions"] == 1
        # 3.5 pages after a tail of one page less 512 bytes: three pages more, right after it.
        big = a.allocate(3 * PAGE + PAGE // 2)
        s, c = consistent(a)
        assert big == rng.base + PAGE + 512 and s["capacity"] == 5 * PAGE and c["pages_mapped"] == 5
        assert s["regions"] == 1 and s["backend_reserves"] == c["maps"] == 3
        for p in [first, *rest]:
            a.free(p)
        consistent(a)


def test_free_space_is_one_block_where_regions_would_have_cut_it():
    sizes = [PAGE + PAGE // 2] * 3
    with mapped() as a, Arena(0, growable=True, alignment=512, region_min=2 * PAGE, region_round=PAGE) as regions:
        for arena in (a, regions):
            live = [arena.allocate(n) for n in sizes]
            for p in live:
                arena.free(p)
        s, r = a.stats(), regions.stats()
        assert s["capacity"] == 5 * PAGE and s["regions"] == 1        # 4.5 pages, contiguous
        assert s["free_blocks"] == 1 and s["largest_free"] == 5 * PAGE
        assert r["capacity"] == 6 * PAGE and r["regions"] == 3        # one region per request
        assert r["largest_free"] == 2 * PAGE


def test_release_unmaps_the_whole_pages_of_free_blocks_and_keeps_what_live_blocks_touch():
    with mapped() as a:
        rng = a.address_range()
        head = a.allocate(1000)                # page 0
        middle = a.allocate(5 * PAGE)          # pages 0-5
        tail = a.allocate(1000)                # page 5
        fill(head, 1000, 1)
        fill(tail, 1000, 2)
        assert a.stats()["capacity"] == 6 * PAGE
        a.free(middle)
        released = a.release_cached()
        s, c = consistent(a)
        assert released == 4 * PAGE and s["capacity"] == 2 * PAGE       # pages 1-4 went
        assert c["unmaps"] == 1 and c["pages_unmapped"] == 4 and s["backend_releases"] == 1
        assert a.regions() == [type(a.regions()[0])(rng.base, PAGE), type(a.regions()[0])(rng.base + 5 * PAGE, PAGE)]
        assert not a.range_mapped(rng.base + PAGE, 4 * PAGE)
        assert intact(head, 1000, 1) and intact(tail, 1000, 2)
        assert a.release_cached() == 0      # what is left free shares pages with live blocks
        # The hole fills again: one map of four pages joins the two stretches, free space merges.
        again = a.allocate(5 * PAGE - 2048)
        s, c = consistent(a)
        assert again == middle and s["regions"] == 1 and c["maps"] == 3 and s["capacity"] == 6 * PAGE
        for p in (head, again, tail):
            a.free(p)
        assert a.release_cached() == 6 * PAGE
        s, c = consistent(a)
        assert s["capacity"] == 0 and s["regions"] == 0 and c["mapped"] == 0 and a.blocks() == []


def test_unmapped_pages_come_back_zero_filled():
    with mapped() as a:
        p = a.allocate(3 * PAGE)
        fill(p, 3 * PAGE, 7)
        a.free(p)
        assert a.release_cached() == 3 * PAGE
        q = a.allocate(3 * PAGE)
        assert q == p and ctypes.string_at(q, 3 * PAGE) == bytes(3 * PAGE)
        assert a.mapping_counters()["pages_mapped"] == 6


def test_the_range_is_reserved_once_and_live_blocks_never_move():
    with mapped() as a:
        rng = a.address_range()
        keep = {}
        for cycle in range(20):
            fresh = [a.allocate((cycle * 7919 + i * 104729) % (3 * PAGE) + 1) for i in range(12)]
            for i, p in enumerate(fresh[::3]):
                keep[p] = ((cycle * 7919 + 3 * i * 104729) % (3 * PAGE) + 1, cycle)
                fill(p, keep[p][0], cycle)
            for p in fresh:
                if p not in keep:
                    a.free(p)
            if cycle % 3 == 0:
                a.release_cached()
            for p, (size, seed) in keep.items():
                assert rng.base <= p < rng.base + rng.size and intact(p, size, seed)
            if cycle % 5 == 4:
                for p in list(keep)[::2]:
                    a.free(p)
                    del keep[p]
            s, c = consistent(a)
            assert a.address_range() == rng
        assert a.release_cached() >= 0
        assert len(pages_touched(a)) * PAGE == a.stats()["capacity"]


def test_release_waits_for_the_stream_work_of_a_free_block_before_unmapping_it():
    with mapped() as a:
        a.set_auto_complete(False)
        p = a.allocate(4 * PAGE, stream=1)
        a.free(p, stream=1)                      # stream 1's work may still use it
        assert a.release_cached() == 4 * PAGE    # the host waited for it first
        s, c = consistent(a)
        assert c["waits"] == 1 and s["event_records"] == 1
        a.set_auto_complete(True)                # now work completes as soon as it is recorded:
        q = a.allocate(4 * PAGE, stream=2)
        a.free(q, stream=2)
        assert a.release_cached() == 4 * PAGE    # the event is recorded, done, and nobody waits
        assert a.mapping_counters()["waits"] == 1


def test_a_free_block_of_a_capturing_stream_stays_mapped():
    with mapped() as a:
        p = a.allocate(4 * PAGE, stream=5)
        a.free(p, stream=5)
        violations = lib.ia_host_capture_violations()
        assert lib.ia_host_capture_begin(5, 99)
        try:
            assert a.release_cached() == 0       # no event may be recorded on it, so nothing is known
            assert a.stats()["capacity"] == 4 * PAGE
        finally:
            lib.ia_host_capture_end(5)
        assert lib.ia_host_capture_violations() == violations
        assert a.release_cached() == 4 * PAGE
        consistent(a)


def test_growth_refused_by_the_backend_releases_cached_pages_and_asks_again():
    with mapped(host_limit=8 * PAGE) as a:
        cached = a.allocate(5 * PAGE)
        live = a.allocate(PAGE)
        a.free(cached)
        big = a.allocate(7 * PAGE)           # 6 + 7 pages > 8: refused, the 5 cached go, asked again
        s, c = consistent(a)
        assert s["retries"] == 1 and c["refusals"] == 1 and s["backend_failures"] == 1
        assert s["capacity"] == 8 * PAGE and big == live + PAGE
        with pytest.raises(ArenaOutOfMemory, match="backend could not reserve"):
            a.allocate(PAGE)
        consistent(a)


def test_the_limit_counts_mapped_bytes_and_cached_pages_are_reused_first():
    with mapped(limit=4 * PAGE) as a:
        p = a.allocate(3 * PAGE)
        with pytest.raises(ArenaOutOfMemory, match="limit"):
            a.allocate(2 * PAGE)
        a.free(p)
        q = a.allocate(4 * PAGE)             # the three cached pages and one more
        s, c = consistent(a)
        assert q == p and s["capacity"] == 4 * PAGE and c["maps"] == 2 and s["retries"] == 0


def test_growth_maps_the_fewest_pages_wherever_they_go():
    with mapped() as a:
        rng = a.address_range()
        a.allocate(PAGE)
        hole = a.allocate(6 * PAGE)
        b = a.allocate(PAGE)
        a.allocate(PAGE - 4096)              # the stretch ends with 4 KiB free
        a.free(hole)
        a.free(b)                             # free pages 1-7 merge
        assert a.release_cached() == 7 * PAGE
        # A gap of 7 pages after page 0 (full, no free tail), and the free 4 KiB ending page 8.
        # 1.5 pages: after the 4 KiB tail it needs 2 pages, in the hole 2 as well: the lower wins.
        x = a.allocate(PAGE + PAGE // 2)
        assert x == rng.base + PAGE and a.mapping_counters()["pages_mapped"] == 11
        consistent(a)


def test_the_guard_sees_every_page_mapped():
    budget = 48 * PAGE
    arena = {}

    def available():  # host memory falls as pages are committed, as on a unified machine
        return budget - arena["a"].mapping_counters()["mapped"]

    with mapped(guard=HostGuard(headroom=4 * PAGE, available=available)) as a:
        arena["a"] = a
        live, refused = [], None
        for i in range(200):
            size = (i * 40503) % (5 * PAGE) + 1
            try:
                live.append(a.allocate(size))
            except ArenaOutOfMemory as e:
                refused = str(e)
                break
            if i % 4 == 3:
                a.free(live.pop(0))
            if i % 9 == 8:
                a.release_cached()
            g, h = a.guard_counters(), a.mapping_counters()
            assert (g["maps"], g["unmaps"], g["mapped"], g["pages_mapped"]) == \
                   (h["maps"], h["unmaps"], h["mapped"], h["pages_mapped"])
        assert refused and "unified memory: mapping" in refused and "headroom" in refused
        s, c = consistent(a)
        assert c["mapped"] <= budget - 4 * PAGE and a.guard_counters()["refusals"] >= 1


def test_a_guard_refusal_gives_cached_pages_back_and_asks_again():
    arena = {}
    with mapped(guard=HostGuard(available=lambda: 10 * PAGE - arena["a"].mapping_counters()["mapped"])) as a:
        arena["a"] = a
        cached = a.allocate(6 * PAGE)
        a.allocate(PAGE)
        a.free(cached)
        a.allocate(8 * PAGE)                   # 7 + 8 pages > 10: refused; the 6 cached go first
        s, c = consistent(a)
        assert s["retries"] == 1 and a.guard_counters()["refusals"] == 1 and c["mapped"] == 9 * PAGE


def test_bad_mapping_arguments_are_refused():
    with pytest.raises(ValueError, match="growable"):
        Arena(0, address_range=MiB)
    with pytest.raises(ValueError, match="page_size"):
        Arena(0, growable=True, page_size=PAGE)
    with pytest.raises(ValueError, match="power of two"):
        Arena(0, growable=True, address_range=MiB, page_size=3 * 4096)
    out = ffi.new("ia_backend_t **")
    assert lib.ia_host_mapping_backend_create(0, 3 * 4096, out) == lib.IA_ERR_INVALID_ARGUMENT
    opts = ffi.new("ia_arena_options_t *")
    lib.ia_arena_default_options(opts)
    opts.growable, opts.address_range = True, MiB
    arena = ffi.new("ia_arena_t **")
    assert lib.ia_host_backend_create(0, out) == lib.IA_OK       # no mapping
    assert lib.ia_arena_create(opts, out[0], arena) == lib.IA_ERR_INVALID_ARGUMENT
    assert lib.ia_host_mapping_backend_create(0, 4096, out) == lib.IA_OK
    opts.alignment = 8192                                          # above the page
    assert lib.ia_arena_create(opts, out[0], arena) == lib.IA_ERR_INVALID_ARGUMENT
    with mapped(address_range=8 * PAGE) as a:
        with pytest.raises(ArenaOutOfMemory):
            a.allocate(9 * PAGE)                                   # wider than the range
        assert a.allocate(8 * PAGE) == a.address_range().base
        assert a.stats()["capacity"] == 8 * PAGE


def test_a_first_capacity_is_mapped_at_creation():
    with Arena(3 * PAGE + 1, growable=True, address_range=MiB, page_size=PAGE, alignment=512) as a:
        s, c = consistent(a)
        assert s["capacity"] == 4 * PAGE and c["maps"] == 1 and a.regions()[0].base == a.address_range().base


# -- every sequence of operations -------------------------------------------------------------------
# Operations weighted by kind (allocations and frees most), sizes from a few bytes to five pages.
OPS = st.lists(st.tuples(
    st.sampled_from(["alloc"] * 5 + ["free"] * 3 + ["record", "release", "complete"]),
    st.one_of(st.integers(1, 2048), st.integers(1, 5 * (16 << 10))),
    st.integers(0, 2)), min_size=40, max_size=200)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, auto=st.booleans())
def test_any_sequence_keeps_pages_mapped_exactly_where_needed(ops, auto):
    """After every operation: the invariants, capacity = mapped bytes, every live block mapped,
    canaries intact, no refused driver call; after a release with every stream's work done: the
    pages mapped are exactly those live blocks touch."""
    with mapped(page=16 << 10, address_range=64 * MiB, host_limit=16 * (16 << 10)) as a:
        a.set_auto_complete(auto)
        live = []
        for op, n, stream in ops:
            n = n if op == "alloc" else n % 64
            if op == "alloc":
                try:
                    p = a.allocate(n, stream=stream)
                except ArenaOutOfMemory:
                    continue
                fill(p, n, len(live))
                live.append((p, n, len(live)))
            elif op == "free" and live:
                p, size, seed = live.pop(n % len(live))
                assert intact(p, size, seed)
                a.free(p, stream=stream)
            elif op == "record" and live:
                a.record_stream(live[n % len(live)][0], stream)
            elif op == "release":
                a.release_cached()
            elif op == "complete":
                a.complete(stream)
            consistent(a)
        for p, size, seed in live:
            assert intact(p, size, seed)
        a.release_cached()  # waits for whatever is pending, so nothing cached may stay
        consistent(a)
        assert a.stats()["capacity"] == len(pages_touched(a)) * a.page_size


# -- traces of a mapping arena -----------------------------------------------------------------------

def merged(spans):
    out = []
    for lo, size in sorted(spans):
        if out and out[-1][1] == lo:
            out[-1][1] = lo + size
        else:
            out.append([lo, lo + size])
    return out


def test_a_trace_of_a_mapping_arena_rebuilds_what_is_mapped():
    """Maps are traced as reserves and unmaps as releases, so a snapshot made from the trace alone
    covers exactly the mapped stretches (a stretch grown by several maps shows as adjacent
    segments)."""
    from arena_tools.export import segments_from_events
    from alloc.trace import Trace
    trace = Trace(1024)
    with mapped() as a:
        trace.attach(a, device=0, pool="large")
        a.allocate(1000)                          # page 0
        big = a.allocate(6 * PAGE)                # pages 0-6, mapped by a second map
        a.allocate(1000)                          # page 6
        a.free(big)
        assert a.release_cached() == 5 * PAGE     # pages 1-5: the middle of a traced map
        a.allocate(3 * PAGE)                      # pages 1-3 again, after page 0's free tail
        events, dropped = trace.events()
        assert dropped == 0 and {e.action for e in events} >= {"reserve", "release"}
        segments = segments_from_events(events)
        assert len(a.regions()) == 2
        assert merged((s["address"], s["total_size"]) for s in segments) == merged((r.base, r.size) for r in a.regions())
