"""The statistics' quantities, each a quadruple (current, peak, allocated, freed), after a scripted
sequence on the host backend: exact values, step by step, with PyTorch's meaning of each
(csrc/arena/arena.h, IA_STAT_QUADS). The GPU comparison with PyTorch's own allocator is
tests/test_stats_gpu.py."""
import pytest

from alloc import Arena
from alloc.arena import QUANTITIES, STAT_NAMES

KiB, MiB = 1 << 10, 1 << 20


def quad(stats: dict, name: str) -> tuple[int, int, int, int]:
    return tuple(stats[k] for k in (name, f"{name}_peak", f"{name}_allocated", f"{name}_freed"))


def test_every_quantity_is_four_keys_of_the_flat_stats():
    assert set(QUANTITIES) == {"in_use", "requested", "blocks", "active", "active_bytes", "capacity",
                               "regions", "inactive_split", "inactive_split_bytes"}
    for name in QUANTITIES:
        assert {name, f"{name}_peak", f"{name}_allocated", f"{name}_freed"} <= set(STAT_NAMES)
    assert {"retries", "backend_reserves", "largest_free", "fragmentation"} <= set(STAT_NAMES)


def test_a_scripted_sequence_gives_each_quantity_exactly():
    a = Arena(0, 512, growable=True, region_min=2 * MiB, region_round=2 * MiB, name="stats")
    a.set_auto_complete(False)  # stream 7's work stays pending: the freeing stream must wait on it
    try:
        # allocate: a new 2 MiB region, split (its 1,948 KiB tail is a free block of a split region)
        p = a.allocate(100 * KiB)
        s = a.stats()
        assert quad(s, "in_use") == (100 * KiB, 100 * KiB, 100 * KiB, 0)
        assert quad(s, "requested") == (100 * KiB, 100 * KiB, 100 * KiB, 0)
        assert quad(s, "blocks") == quad(s, "active") == (1, 1, 1, 0)
        assert quad(s, "active_bytes") == quad(s, "in_use")
        assert quad(s, "capacity") == (2 * MiB, 2 * MiB, 2 * MiB, 0)
        assert quad(s, "regions") == (1, 1, 1, 0)
        assert quad(s, "inactive_split") == (1, 1, 1, 0)
        assert quad(s, "inactive_split_bytes") == (2 * MiB - 100 * KiB,) * 3 + (0,)

        # allocate from the split tail: its free block shrinks by the 1 KiB taken (rounded from 1000)
        q = a.allocate(1000)
        s = a.stats()
        assert quad(s, "in_use") == (101 * KiB, 101 * KiB, 101 * KiB, 0)
        assert quad(s, "requested") == (100 * KiB + 1000, 100 * KiB + 1000, 100 * KiB + 1000, 0)
        assert quad(s, "blocks") == (2, 2, 2, 0)
        assert quad(s, "inactive_split") == (1, 1, 1, 0)
        assert quad(s, "inactive_split_bytes") == (2 * MiB - 101 * KiB, 2 * MiB - 100 * KiB,
                                                   2 * MiB - 100 * KiB, KiB)

        # free: the first block becomes a second free block of the split region
        a.free(p)
        s = a.stats()
        assert quad(s, "in_use") == (KiB, 101 * KiB, 101 * KiB, 100 * KiB)
        assert quad(s, "requested") == (1000, 100 * KiB + 1000, 100 * KiB + 1000, 100 * KiB)
        assert quad(s, "blocks") == quad(s, "active") == (1, 2, 2, 1)
        assert quad(s, "inactive_split") == (2, 2, 2, 0)
        assert quad(s, "inactive_split_bytes") == (2 * MiB - KiB, 2 * MiB - KiB, 2 * MiB, KiB)

        # a free delayed by record_stream: the freeing stream waits on stream 7's event; the block
        # is reusable at once (active follows allocation), and merges both neighbours: one whole
        # free region, so no free block of a split region is left
        a.record_stream(q, 7)
        a.free(q, 0)
        s = a.stats()
        assert s["event_records"] == 1 and s["stream_waits"] == 1
        assert quad(s, "in_use") == quad(s, "active_bytes") == (0, 101 * KiB, 101 * KiB, 101 * KiB)
        assert quad(s, "blocks") == quad(s, "active") == (0, 2, 2, 2)
        assert quad(s, "requested") == (0, 100 * KiB + 1000, 100 * KiB + 1000, 100 * KiB + 1000)
        assert quad(s, "inactive_split") == (0, 2, 2, 2)
        assert quad(s, "inactive_split_bytes") == (0, 2 * MiB - KiB, 2 * MiB, 2 * MiB)
        a.complete(7)

        # split of a large region: 3 MiB reserves 4 MiB (2 MiB steps), its 1 MiB tail stays free;
        # 512 KiB comes from that tail (best fit), not from the whole free 2 MiB region
        c = a.allocate(3 * MiB)
        d = a.allocate(512 * KiB)
        s = a.stats()
        assert quad(s, "capacity") == (6 * MiB, 6 * MiB, 6 * MiB, 0)
        assert quad(s, "regions") == (2, 2, 2, 0)
        assert quad(s, "inactive_split") == (1, 2, 3, 2)
        assert quad(s, "inactive_split_bytes") == (512 * KiB, 2 * MiB - KiB, 3 * MiB, 2 * MiB + 512 * KiB)

        # merge: the freed 512 KiB joins the tail, which stays one free block of a split region
        a.free(d)
        s = a.stats()
        assert quad(s, "inactive_split") == (1, 2, 3, 2)
        assert quad(s, "inactive_split_bytes") == (MiB, 2 * MiB - KiB, 3 * MiB + 512 * KiB, 2 * MiB + 512 * KiB)
        assert quad(s, "in_use") == (3 * MiB, 3 * MiB + 512 * KiB, 3 * MiB + 613 * KiB, 613 * KiB)

        # region release: both regions whole and free go back to the backend
        a.free(c)
        assert a.release_cached() == 6 * MiB
        s = a.stats()
        assert quad(s, "capacity") == (0, 6 * MiB, 6 * MiB, 6 * MiB)
        assert quad(s, "regions") == (0, 2, 2, 2)
        assert quad(s, "inactive_split") == (0, 2, 3, 3)
        assert quad(s, "inactive_split_bytes") == (0, 2 * MiB - KiB, 3 * MiB + 512 * KiB, 3 * MiB + 512 * KiB)
        assert quad(s, "blocks") == (0, 2, 4, 4) and s["backend_reserves"] == s["backend_releases"] == 2
        a.check()

        a.reset_peaks()
        s = a.stats()
        for name in QUANTITIES:
            assert s[f"{name}_peak"] == s[name] == 0, name
        assert s["in_use_allocated"] == 3 * MiB + 613 * KiB  # the sums are not reset
    finally:
        a.close()


def test_a_mapping_arena_counts_no_inactive_split_as_pytorch_counts_none_in_expandable_segments():
    page = 2 * MiB
    a = Arena(0, 512, growable=True, address_range=64 * MiB, page_size=page)
    try:
        p = a.allocate(100 * KiB)
        q = a.allocate(3 * MiB)
        a.free(p)
        s = a.stats()
        assert s["free_blocks"] == 2 and quad(s, "inactive_split") == (0, 0, 0, 0)
        assert quad(s, "inactive_split_bytes") == (0, 0, 0, 0)
        assert quad(s, "capacity") == (2 * page, 2 * page, 2 * page, 0)
        assert quad(s, "regions") == (1, 1, 1, 0)  # one mapped stretch
        a.free(q)
        a.check()
    finally:
        a.close()


def test_the_invariant_walk_holds_the_quantities_after_a_random_workload():
    import random
    rng = random.Random(20)
    a = Arena(0, 512, growable=True, region_min=2 * MiB)
    live = []
    try:
        for _ in range(3000):
            if live and rng.random() < 0.45:
                a.free(live.pop(rng.randrange(len(live))), rng.choice([0, 0, 3]))
            else:
                live.append(a.allocate(rng.choice([100, 4 * KiB, 60 * KiB, 700 * KiB, 3 * MiB]), rng.choice([0, 3])))
            if rng.random() < 0.02:
                a.release_cached()
        a.check()  # every quantity's current against the walk, current = allocated - freed <= peak
        s = a.stats()
        assert s["blocks"] == len(live) and s["blocks_allocated"] - s["blocks_freed"] == len(live)
    finally:
        for p in live:
            a.free(p)
        a.close()


PLUGIN = """
import alloc
from alloc import plugin
from alloc._lib import ffi, lib
c = ffi.new("ia_plugin_config_t *")
c.budget, c.alignment, c.unified, c.host_memory, c.expandable = 64 << 20, 256, 0, 1, 0
assert lib.ia_plugin_configure(c) == lib.IA_OK
MiB = 1 << 20
def alloc_(size):
    return lib.ia_torch_alloc(size, 0, ffi.cast("void *", 0), ffi.NULL)
small = alloc_(4096)
large = alloc_(3 * MiB)
lib.ia_torch_free(small)
big = alloc_(12 * MiB)
lib.ia_torch_free(large)
s = plugin.memory_stats(0)
pools = {p: alloc.device_arena(0, p).stats() for p in ("small", "large")}
# every family, kind and field is there, and nothing else of PyTorch's shape
families = ("allocated_bytes", "requested_bytes", "allocation", "active", "active_bytes", "reserved_bytes",
            "segment", "inactive_split", "inactive_split_bytes")
keys = {k for k in s if not k.startswith("arena.")}
assert keys == {f"{f}.{k}.{n}" for f in families for k in ("all", "small_pool", "large_pool")
                for n in ("current", "peak", "allocated", "freed")} | {
    "num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free"}, sorted(keys)
# the table: PyTorch's family for the arena's quantity, the small and large pools apart
for family, name in (("allocated_bytes", "in_use"), ("requested_bytes", "requested"), ("allocation", "blocks"),
                     ("active", "active"), ("active_bytes", "active_bytes"), ("reserved_bytes", "capacity"),
                     ("segment", "regions"), ("inactive_split", "inactive_split"),
                     ("inactive_split_bytes", "inactive_split_bytes")):
    for kind, pool in (("small_pool", "small"), ("large_pool", "large")):
        st = pools[pool]
        assert (s[f"{family}.{kind}.current"], s[f"{family}.{kind}.peak"], s[f"{family}.{kind}.allocated"],
                s[f"{family}.{kind}.freed"]) == (st[name], st[name + "_peak"], st[name + "_allocated"],
                                                 st[name + "_freed"]), (family, kind)
        assert s[f"{family}.all.current"] == s[f"{family}.small_pool.current"] + s[f"{family}.large_pool.current"]
        assert s[f"{family}.all.allocated"] == s[f"{family}.small_pool.allocated"] + s[f"{family}.large_pool.allocated"]
# the device's peaks are peaks of the sum, not sums of peaks: 4 KiB and 3 MiB were live together,
# then 3 MiB and 12 MiB; never all three
assert s["allocation.all.peak"] == 2 and s["allocation.small_pool.peak"] + s["allocation.large_pool.peak"] == 3
assert s["allocated_bytes.all.peak"] == 15 * MiB and s["allocated_bytes.all.current"] == 12 * MiB
assert s["requested_bytes.all.peak"] == 15 * MiB
assert s["active_bytes.all.peak"] == s["allocated_bytes.all.peak"]
assert s["reserved_bytes.all.current"] == 2 * MiB + 20 * MiB  # 12 MiB fits the 20 MiB region
assert s["segment.all.current"] == 2 and s["num_device_alloc"] == 2 and s["num_ooms"] == 0
assert plugin.max_memory_allocated(0) == 15 * MiB and plugin.memory_reserved(0) == 22 * MiB
plugin.reset_peak_memory_stats(0)
assert plugin.memory_stats(0)["allocation.all.peak"] == 1
print("ok")
"""


def test_memory_stats_is_the_core_s_table_of_pytorch_s_keys(fresh_python):
    done = fresh_python(PLUGIN)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


ROUNDED = """
import random
from alloc import plugin
from alloc._lib import ffi, lib
c = ffi.new("ia_plugin_config_t *")
c.budget, c.alignment, c.unified, c.host_memory, c.expandable = 64 << 20, 512, 0, 1, 0
assert lib.ia_plugin_configure(c) == lib.IA_OK
MiB = 1 << 20
rng = random.Random(3)
edges = [(1, 0), (1, 1), (512, 513), (MiB, MiB + 1), (MiB + 1, MiB), (3 * MiB, 4 * MiB), (84 * MiB, 96 * MiB)]
cases = [(size, reserve, graph) for size, reserve in edges for graph in (False, True)] + [
    (size, max(0, size + rng.randint(-4 * MiB, 8 * MiB)), rng.random() < 0.5)
    for size in (int(2 ** rng.uniform(0, 24.5)) for _ in range(300))]
for n, (size, reserve, graph) in enumerate(cases):
    pool = ffi.new("ia_pool_id_t *", (n + 1, 0)) if graph else ffi.NULL
    if graph:
        assert lib.ia_graph_begin(0, pool[0]) == lib.IA_OK
    before = plugin.memory_stats(0)
    p = lib.ia_torch_alloc_rounded(size, reserve, 0, ffi.cast("void *", 0), pool)
    after = plugin.memory_stats(0)
    block = -(-max(size, reserve) // 512) * 512  # never less than the request, 512-byte steps
    assert after["requested_bytes.all.allocated"] - before["requested_bytes.all.allocated"] == size
    assert after["active_bytes.all.allocated"] - before["active_bytes.all.allocated"] == block, (size, reserve)
    lib.ia_torch_free(p)
    if graph:
        assert lib.ia_graph_end(0, pool[0]) == lib.IA_OK
        assert lib.ia_graph_release(0, pool[0]) == lib.IA_OK
    assert plugin.memory_stats(0)["active_bytes.all.current"] == before["active_bytes.all.current"]
print("ok")
"""


def test_a_rounded_request_takes_the_rounded_block_and_counts_its_own_bytes_as_requested(fresh_python):
    # PyTorch's roundup_power2_divisions reaches the core as a reserve over the request
    done = fresh_python(ROUNDED)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


@pytest.mark.parametrize("order", ["larger first", "smaller first"])
def test_the_largest_free_block_is_the_largest_of_its_size_class_whatever_the_order_freed(order):
    """Two free blocks of one size class (100 KiB and 100 KiB + 256 bytes; a class spans 2 KiB
    there), the rest of the arena live: largest_free is the larger, whichever was freed last (a bin
    lists its blocks in the order they came, so its first block need not be its largest)."""
    with Arena(MiB, 256) as a:
        big, small = 100 * KiB + 256, 100 * KiB
        p = a.allocate(big)
        a.allocate(256)
        q = a.allocate(small)
        a.allocate(256)
        a.allocate(a.stats()["free_bytes"])  # the rest, so that no other block is free
        for block in ((p, q) if order == "larger first" else (q, p)):
            a.free(block)
        s = a.stats()
        assert s["free_blocks"] == 2 and s["free_bytes"] == big + small
        assert s["largest_free"] == big
        assert s["fragmentation"] == pytest.approx(1 - big / (big + small), rel=1e-12)
        a.check()


def test_a_split_leaves_its_free_tail_at_most_its_own_size_requested():
    """A free block keeps the requested bytes of the allocation last freed into it (as PyTorch's
    snapshot shows); a split hands its head out and the free tail keeps that figure, cut to the
    tail's own size: no block, free or live, says more bytes were asked of it than it holds."""
    with Arena(MiB, 256) as a:
        p = a.allocate(300 * KiB - 5)
        a.allocate(256)
        a.free(p)
        (freed,) = [b for b in a.blocks() if b.address == p]
        assert freed.state == "free" and freed.requested == 300 * KiB - 5
        head = a.allocate(100 * KiB)  # from p's block, the better fit
        assert head == p
        (tail,) = [b for b in a.blocks() if b.address == p + 100 * KiB]
        assert tail.state == "free" and tail.size == 200 * KiB and tail.requested == 200 * KiB
        a.allocate(50 * KiB + 3)  # the tail splits again: its tail keeps the cut figure, cut again
        (rest,) = [b for b in a.blocks() if b.address == p + 150 * KiB + 256]
        assert rest.state == "free" and rest.requested == rest.size == 150 * KiB - 256
        assert all(b.requested <= b.size for b in a.blocks())
        a.check()
