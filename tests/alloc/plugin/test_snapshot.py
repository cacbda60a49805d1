"""What PyTorch's memory tools read from the core, on the host backend: the device's segments
(csrc/torch/plugin_segments.c), the trace sink that memory history listens to (csrc/arena/trace.c,
ia_plugin_trace_sink), and the accumulated counters PyTorch resets. Each test runs in a fresh
interpreter, since the plugin is configured once per process."""

import pytest

from tests.support import run_python

PRELUDE = """
from alloc._lib import ffi, lib
c = ffi.new("ia_plugin_config_t *")
c.budget, c.alignment, c.unified, c.host_memory = 64 << 20, 256, 0, 1
assert lib.ia_plugin_configure(c) == lib.IA_OK
MiB = 1 << 20

def segments():
    out = []
    @ffi.callback("void(void *, const ia_segment_info_t *, const ia_block_info_t *, size_t)")
    def add(ctx, seg, blocks, n):
        out.append({"address": seg.address, "size": seg.size, "pool": seg.pool,
                    "graph": (seg.graph_pool.first, seg.graph_pool.second),
                    "blocks": [(b.address, b.size, b.requested, bool(b.is_free)) for b in blocks[0:n]]})
    lib.ia_plugin_segments(0, add, ffi.NULL)
    return out

def alloc(size, stream=1, pool=None):
    return int(ffi.cast("uintptr_t", lib.ia_torch_alloc(size, 0, ffi.cast("void *", stream),
                                                         pool if pool is not None else ffi.NULL)))
"""


def run(body: str) -> None:
    done = run_python(PRELUDE + body + "\nprint('ok')\n")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_segments_are_tiled_by_their_blocks_and_name_their_pool():
    run("""
small = [alloc(4096) for _ in range(5)]
large = alloc(3 * MiB)
lib.ia_workspace_enter(); ws = alloc(MiB); lib.ia_workspace_exit()
p = ffi.new("ia_pool_id_t *"); p.first, p.second = 0, 9
assert lib.ia_graph_begin(0, p[0]) == lib.IA_OK
g = alloc(5 * MiB, 2, p)
assert lib.ia_graph_end(0, p[0]) == lib.IA_OK
lib.ia_torch_free(ffi.cast("void *", small[2]))
segs = segments()
for s in segs:
    at = s["address"]
    for address, size, requested, free in s["blocks"]:  # in address order, no gap, no overlap
        assert address == at and (free or requested > 0)
        at += size
    assert at == s["address"] + s["size"]
# A free block keeps the requested bytes of the allocation freed into it, as PyTorch's does.
assert [b for s in segs for b in s["blocks"] if b[0] == small[2]] == [(small[2], 4096, 4096, True)]
live = {b[0]: (s["pool"], s["graph"]) for s in segs for b in s["blocks"] if not b[3]}
assert live == {**{a: (lib.IA_POOL_SMALL, (0, 0)) for a in small if a != small[2]},
                large: (lib.IA_POOL_LARGE, (0, 0)), ws: (lib.IA_POOL_WORKSPACE, (0, 0)),
                g: (lib.IA_TRACE_POOL_GRAPH_LARGE, (0, 9))}
""")


def test_the_sink_sees_every_arena_graph_pools_included_and_nothing_after_it_is_removed():
    run("""
events = []
@ffi.callback("void(void *, const ia_trace_event_t *)")
def sink(ctx, e):
    events.append((e.action, e.pool, e.address, e.size))
held = alloc(4096)                         # the pools exist before the sink
assert lib.ia_plugin_trace_sink(sink, ffi.NULL) == lib.IA_OK
events.clear()                             # the regions already held are replayed first
a = alloc(2 * MiB)
p = ffi.new("ia_pool_id_t *"); p.first, p.second = 3, 0
assert lib.ia_graph_begin(0, p[0]) == lib.IA_OK
g = alloc(4096, 2, p)
assert lib.ia_graph_end(0, p[0]) == lib.IA_OK
lib.ia_torch_free(ffi.cast("void *", g))
assert lib.ia_graph_release(0, p[0]) == lib.IA_OK   # the pool goes: its region is given back
lib.ia_torch_free(ffi.cast("void *", a))
assert (lib.IA_TRACE_ALLOC, lib.IA_POOL_LARGE, a, 2 * MiB) in events
assert (lib.IA_TRACE_ALLOC, lib.IA_TRACE_POOL_GRAPH_SMALL, g, 4096) in events
assert any(e[0] == lib.IA_TRACE_RESERVE and e[1] == lib.IA_TRACE_POOL_GRAPH_SMALL for e in events)
assert any(e[0] == lib.IA_TRACE_RELEASE and e[1] == lib.IA_TRACE_POOL_GRAPH_SMALL for e in events)
assert any(e[0] == lib.IA_TRACE_FREE and e[2] == a for e in events)
assert lib.ia_plugin_trace_sink(ffi.NULL, ffi.NULL) == lib.IA_OK
n = len(events)
lib.ia_torch_free(ffi.cast("void *", alloc(8192)))
assert len(events) == n
""")


def test_a_graph_pools_arenas_carry_the_trace_tags_that_files_hold():
    # Trace files, reports and PyTorch's history hold these numbers: they never change.
    run("""
assert (lib.IA_POOL_WORKSPACE, lib.IA_POOL_SMALL, lib.IA_POOL_LARGE) == (0, 1, 2)
assert lib.IA_TRACE_POOL_GRAPH == 3
assert (lib.IA_TRACE_POOL_GRAPH_SMALL, lib.IA_TRACE_POOL_GRAPH_LARGE, lib.IA_TRACE_POOL_GRAPH_WORKSPACE) == (3, 4, 5)
events = []
@ffi.callback("void(void *, const ia_trace_event_t *)")
def sink(ctx, e):
    events.append((e.action, e.pool, e.address))
assert lib.ia_plugin_reserve(0) == lib.IA_OK
assert lib.ia_plugin_trace_sink(sink, ffi.NULL) == lib.IA_OK
p = ffi.new("ia_pool_id_t *"); p.first, p.second = 4, 0
assert lib.ia_graph_begin(0, p[0]) == lib.IA_OK
small, large = alloc(4096, 2, p), alloc(3 * MiB, 2, p)
lib.ia_workspace_enter(); ws = alloc(MiB, 2, p); lib.ia_workspace_exit()
assert lib.ia_graph_end(0, p[0]) == lib.IA_OK
allocs = [(pool, a) for action, pool, a in events if action == lib.IA_TRACE_ALLOC]
assert (3, small) in allocs and (4, large) in allocs and (5, ws) in allocs
assert (0, ws) in allocs  # the carve-out's region: a block of the device's workspace arena
assert lib.ia_plugin_trace_sink(ffi.NULL, ffi.NULL) == lib.IA_OK
""")


def test_accumulated_counters_count_from_a_reset_and_currents_stay():
    run("""
def torch_stats():
    s = ffi.new("ia_torch_stats_t *")
    lib.ia_plugin_torch_stats(0, s)
    return s
keep = [alloc(4096) for _ in range(3)]
lib.ia_torch_free(ffi.cast("void *", keep.pop()))
before = torch_stats()
assert before.allocation[0].allocated == 3 and before.allocation[0].freed == 1
lib.ia_plugin_reset_accumulated(0)
s = torch_stats()
assert (s.allocation[0].allocated, s.allocation[0].freed, s.allocation[0].current) == (0, 0, 2)
assert s.allocated_bytes[0].current == before.allocated_bytes[0].current and s.num_device_alloc == 0
lib.ia_torch_free(ffi.cast("void *", keep.pop()))
s = torch_stats()
assert (s.allocation[0].allocated, s.allocation[0].freed, s.allocation[0].current) == (0, 1, 1)
""")


def test_graph_pools_count_in_pytorchs_small_and_large_pool_statistics():
    run("""
def torch_stats():
    s = ffi.new("ia_torch_stats_t *")
    lib.ia_plugin_torch_stats(0, s)
    return s
eager = alloc(4096)
before = torch_stats()
p = ffi.new("ia_pool_id_t *"); p.first, p.second = 0, 5
assert lib.ia_graph_begin(0, p[0]) == lib.IA_OK
small, large = alloc(4096, 2, p), alloc(3 * MiB, 2, p)
assert lib.ia_graph_end(0, p[0]) == lib.IA_OK
s = torch_stats()
assert s.allocation[1].current - before.allocation[1].current == 1          # small_pool
assert s.allocation[2].current - before.allocation[2].current == 1          # large_pool
assert s.reserved_bytes[1].current - before.reserved_bytes[1].current == 2 * MiB   # PyTorch's segments
assert s.reserved_bytes[2].current - before.reserved_bytes[2].current == 20 * MiB
assert s.segment[0].current == s.segment[1].current + s.segment[2].current
""")


def test_the_ring_keeps_its_capacity_and_eager_pools_only_while_a_sink_listens():
    run("""
@ffi.callback("void(void *, const ia_trace_event_t *)")
def sink(ctx, e):
    pass
assert lib.ia_plugin_trace_sink(sink, ffi.NULL) == lib.IA_OK   # history first: a ring of its own
assert lib.ia_plugin_trace_start(1000) == lib.IA_OK           # then trace:1000
ring = lib.ia_plugin_trace()
assert lib.ia_trace_capacity(ring) == 1000
lib.ia_trace_clear(ring)
p = ffi.new("ia_pool_id_t *"); p.first, p.second = 0, 6
assert lib.ia_graph_begin(0, p[0]) == lib.IA_OK
g = alloc(4096, 2, p)
assert lib.ia_graph_end(0, p[0]) == lib.IA_OK
e = alloc(4096)
events = ffi.new("ia_trace_event_t[]", 1000)
n = lib.ia_trace_read(ring, events, 1000, ffi.NULL)
allocs = [(x.action, x.address, x.pool) for x in events[0:n] if x.action != lib.IA_TRACE_RESERVE]
assert allocs == [(lib.IA_TRACE_ALLOC, e, lib.IA_POOL_SMALL)], allocs   # not the graph pool's
""")


def test_pytorchs_kinds_add_up_to_the_device_for_any_eager_workspace_and_graph_allocations():
    pytest.importorskip("hypothesis")
    # memory_stats()'s "all" figures are the device totals, kept apart from the arenas' own
    # counters; its small_pool and large_pool sum the general pools with the graph pools' arenas
    # of their kind. Whatever is live, all = small + large + the workspace arena, small and large
    # count the live blocks by PyTorch's size rule, and all's peak is the highest the device's
    # current reached (the arenas' peaks, reached at other times, sum to more).
    run("""
from hypothesis import given, settings, strategies as st, HealthCheck

# PyTorch's family and the arena's name of each quantity the device totals keep
TOTALS = [("allocation", "blocks"), ("allocated_bytes", "in_use"), ("requested_bytes", "requested"),
         ("reserved_bytes", "capacity"), ("segment", "regions")]
size = st.one_of(st.integers(1, MiB - 4096), st.integers(MiB + 1, 6 * MiB))
op = st.tuples(st.sampled_from(["eager", "eager", "workspace", "graph", "free", "free"]), size,
               st.integers(0, 63))
counter = iter(range(100, 10**6))
highest = {}  # torch family -> the highest "all" current seen after any operation

def check(live):
    s = ffi.new("ia_torch_stats_t *")
    lib.ia_plugin_torch_stats(0, s)
    ws = ffi.new("ia_stats_t *")
    arena = lib.ia_plugin_arena(0, lib.IA_POOL_WORKSPACE)
    if arena != ffi.NULL:
        lib.ia_arena_stats(arena, ws)
    for torch, own in TOTALS:
        kinds = getattr(s, torch)
        assert kinds[0].current == kinds[1].current + kinds[2].current + getattr(ws, own).current, torch
        if torch in ("allocation", "allocated_bytes", "requested_bytes"):  # peaks reached at an operation's end
            highest[torch] = max(highest.get(torch, 0), kinds[0].current)
            assert kinds[0].peak == highest[torch], torch
    counted = [n for where, n in live.values() if where != "workspace"]
    small = sum(n <= MiB for n in counted)
    assert (s.allocation[1].current, s.allocation[2].current) == (small, len(counted) - small)
    assert s.allocated_bytes[0].current >= s.requested_bytes[0].current == sum(n for _, n in live.values())

@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(op, max_size=60))
def program(ops):
    p = ffi.new("ia_pool_id_t *"); p.first, p.second = 0, next(counter)
    assert lib.ia_graph_begin(0, p[0]) == lib.IA_OK
    live = {}
    for where, n, pick in ops:
        if where == "free":
            if live:
                address = sorted(live)[pick % len(live)]
                lib.ia_torch_free(ffi.cast("void *", address))
                del live[address]
        else:
            if where == "workspace":
                lib.ia_workspace_enter()
            live[alloc(n, 2, p) if where == "graph" else alloc(n)] = (where, n)
            if where == "workspace":
                lib.ia_workspace_exit()
        check(live)
    assert lib.ia_graph_end(0, p[0]) == lib.IA_OK
    check(live)
    for address in list(live):
        lib.ia_torch_free(ffi.cast("void *", address))
        del live[address]
        check(live)
    assert lib.ia_graph_release(0, p[0]) == lib.IA_OK
    check(live)

program()
""")


def test_cumulative_counters_keep_the_history_of_released_arenas_and_never_run_backwards():
    # Issue 47: PyTorch's allocated/freed sums and device alloc/free counts only grow until
    # reset_accumulated_memory_stats(). They were summed over the arenas alive at the time, so a
    # workspace release or a graph pool's release took their history away (and made them negative
    # after a reset). Over random sequences of every operation that makes or ends an arena: no
    # cumulative figure goes down, allocated - freed is the current value (less what was current at
    # the last reset) for every family and kind, and each release of a reserved workspace arena is
    # one device free.
    run("""
from hypothesis import given, settings, strategies as st, HealthCheck

FAMILIES = ["allocation", "allocated_bytes", "requested_bytes", "reserved_bytes", "segment"]
op = st.tuples(st.sampled_from(["eager", "workspace", "graph", "free", "free", "release", "reserve",
                                "reset_accumulated", "reset_peaks"]),
               st.one_of(st.integers(1, MiB), st.integers(MiB + 1, 6 * MiB)), st.integers(0, 63))
counter = iter(range(100, 10**6))

def torch_stats():
    s = ffi.new("ia_torch_stats_t *")
    lib.ia_plugin_torch_stats(0, s)
    return s

def figures(s):
    out = {}
    for f in FAMILIES:
        for k in range(3):
            q = getattr(s, f)[k]
            out[f, k] = (q.current, q.allocated, q.freed)
    return out

@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(op, max_size=40))
def program(ops):
    lib.ia_plugin_reset_accumulated(0)
    base = {key: current for key, (current, _, _) in figures(torch_stats()).items()}
    last = torch_stats()
    live, pools = {}, []
    for what, n, pick in ops:
        reserved = lib.ia_plugin_workspace_reserved(0)
        if what == "free" and live:
            address = sorted(live)[pick % len(live)]
            lib.ia_torch_free(ffi.cast("void *", address))
            del live[address]
        elif what == "release":
            released = lib.ia_plugin_release(0) == lib.IA_OK
            assert released == (not any(w == "workspace" for w in live.values()))
            while pools:  # the graph pools go too, each with its arenas
                assert lib.ia_graph_release(0, pools.pop()[0]) == lib.IA_OK
        elif what == "reserve":
            assert lib.ia_plugin_reserve(0) == lib.IA_OK
        elif what == "reset_accumulated":
            lib.ia_plugin_reset_accumulated(0)
            base = {key: current for key, (current, _, _) in figures(torch_stats()).items()}
            last = torch_stats()
        elif what == "reset_peaks":
            lib.ia_plugin_reset_peaks(0)
        elif what == "graph":
            p = ffi.new("ia_pool_id_t *"); p.first, p.second = 0, next(counter)
            assert lib.ia_graph_begin(0, p[0]) == lib.IA_OK
            live[alloc(n, 2, p)] = what
            assert lib.ia_graph_end(0, p[0]) == lib.IA_OK
            pools.append(p)
        elif what in ("eager", "workspace") and not (what == "workspace" and n > 8 * MiB):
            if what == "workspace":
                lib.ia_workspace_enter()
            live[alloc(n)] = what
            if what == "workspace":
                lib.ia_workspace_exit()
        now = torch_stats()
        for key, (current, allocated, freed) in figures(now).items():
            _, was_allocated, was_freed = figures(last)[key]
            assert allocated >= was_allocated and freed >= was_freed, (what, key)
            assert allocated - freed == current - base[key], (what, key, allocated, freed, current, base[key])
        for counter_name in ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms"):
            assert getattr(now, counter_name) >= max(0, getattr(last, counter_name)), (what, counter_name)
        if what == "release" and reserved and released:
            # every region given back is one device free, the workspace arena's among them
            assert now.num_device_free - last.num_device_free == now.segment[0].freed - last.segment[0].freed >= 1
            assert now.reserved_bytes[0].freed - last.reserved_bytes[0].freed >= 64 * MiB
        last = now
    for address in list(live):
        lib.ia_torch_free(ffi.cast("void *", address))
    while pools:
        assert lib.ia_graph_release(0, pools.pop()[0]) == lib.IA_OK

program()
""")


def test_a_view_of_the_workspace_arena_taken_before_a_release_stays_valid():
    # Issue 47: the view read freed memory after release() (its check() found a corrupt bitmap).
    # The device's arenas live as long as the process (Note [Device lifetime], csrc/torch/plugin.h): the
    # view shows an arena that holds nothing until the next reservation, then the same arena again.
    run("""
import alloc.plugin as plugin
assert lib.ia_plugin_reserve(0) == lib.IA_OK
view = plugin.device_arena(0, "workspace")
lib.ia_workspace_enter(); ws = alloc(3 * MiB); lib.ia_workspace_exit()
lib.ia_torch_free(ffi.cast("void *", ws))
before = view.stats()
assert lib.ia_plugin_release(0) == lib.IA_OK and not plugin.workspace_reserved(0)
view.check()
after = view.stats()
assert after["capacity"] == 0 and after["regions"] == 0 and view.blocks() == []
assert after["in_use_allocated"] == before["in_use_allocated"] == after["in_use_freed"]
assert after["capacity_freed"] == 64 * MiB and after["backend_releases"] == before["backend_releases"] + 1
lib.ia_workspace_enter(); ws = alloc(MiB); lib.ia_workspace_exit()  # the next workspace wakes it
assert plugin.workspace_reserved(0) and plugin.device_arena(0, "workspace")._arena == view._arena
view.check()
assert view.stats()["capacity"] == 64 * MiB and view.stats()["blocks"] == 1
lib.ia_torch_free(ffi.cast("void *", ws))
""")


def test_a_release_while_a_graph_captures_is_refused_saying_why():
    # A capture may not see memory given back (the driver's free synchronizes the device): the
    # workspace arena sleeps only once the capture has ended.
    run("""
assert lib.ia_plugin_reserve(0) == lib.IA_OK
p = ffi.new("ia_pool_id_t *"); p.first, p.second = 0, 5
assert lib.ia_graph_begin(0, p[0]) == lib.IA_OK
assert lib.ia_plugin_release(0) == lib.IA_ERR_INVALID_ARGUMENT
assert ffi.string(lib.ia_plugin_failure()).decode() == (
    "a CUDA graph is being captured on it; release once the capture has ended")
assert lib.ia_plugin_workspace_reserved(0)
assert lib.ia_graph_end(0, p[0]) == lib.IA_OK and lib.ia_graph_release(0, p[0]) == lib.IA_OK
assert lib.ia_plugin_release(0) == lib.IA_OK and not lib.ia_plugin_workspace_reserved(0)
""")
