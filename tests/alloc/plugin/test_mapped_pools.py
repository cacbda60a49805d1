"""The plugin's general pools over the host mapping backend (the process scope's mapped pools,
each run in a fresh interpreter), and the GPU figures of plugin/test_expandable.py replayed there."""

from tests.support import run_python

MiB = 1 << 20

# -- the plugin's general pools, mapped --------------------------------------------------------------
PLUGIN = """
import types
from alloc._lib import ffi, lib
from alloc.arena import stats_dict
c = ffi.new("ia_plugin_config_t *")
c.budget, c.alignment, c.unified, c.host_memory, c.expandable = 64 << 20, 256, 0, 1, {expandable}
c.address_range = {address_range}
assert lib.ia_plugin_configure(c) == lib.IA_OK
MiB = 1 << 20
def alloc(size, s=0, p=None):
    return int(ffi.cast("uintptr_t", lib.ia_torch_alloc(size, 0, ffi.cast("void *", s), p if p is not None else ffi.NULL)))
def free(ptr):
    lib.ia_torch_free(ffi.cast("void *", ptr))
def stats(pool):
    s = ffi.new("ia_stats_t *")
    lib.ia_arena_stats(lib.ia_plugin_arena(0, pool), s)
    return types.SimpleNamespace(**stats_dict(s))
def check():
    msg = ffi.new("char[]", 512)
    for pool in (lib.IA_POOL_SMALL, lib.IA_POOL_LARGE):
        assert lib.ia_arena_check(lib.ia_plugin_arena(0, pool), msg, 512), ffi.string(msg)
    assert lib.ia_host_capture_violations() == 0
"""


def plugin(body, expandable=1, address_range=0):
    done = run_python(PLUGIN.format(expandable=expandable, address_range=address_range) + body)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
    return done


def test_the_plugin_maps_the_general_pools_and_empty_cache_unmaps_them():
    plugin("""
x = alloc(5 * MiB)                       # regions would reserve 20 MiB for it
small = [alloc(1000) for _ in range(3000)]
assert lib.ia_plugin_device_expandable(0)
large, little = stats(lib.IA_POOL_LARGE), stats(lib.IA_POOL_SMALL)
assert lib.ia_arena_page_size(lib.ia_plugin_arena(0, lib.IA_POOL_LARGE)) == 2 * MiB
assert large.capacity == 6 * MiB and large.regions == 1 and little.capacity == 4 * MiB, (large.capacity, little.capacity)
assert lib.ia_plugin_device_totals(0).capacity.current == 10 * MiB
r = ffi.new("ia_region_info_t *")
assert lib.ia_arena_address_range(lib.ia_plugin_arena(0, lib.IA_POOL_LARGE), r) and r.size == 8 << 30
for p in small[1:]:
    free(p)
free(x)
lib.ia_torch_empty_cache()
check()
assert stats(lib.IA_POOL_LARGE).capacity == 0 and stats(lib.IA_POOL_SMALL).capacity == 2 * MiB
free(small[0])
y = alloc(5 * MiB)                       # the same address: the range never moves
assert y == x
free(y)
lib.ia_torch_empty_cache()
assert lib.ia_plugin_device_totals(0).capacity.current == 0
check()
print("ok")
""")


def test_the_plugin_keeps_regions_when_expandable_is_off():
    plugin("""
x = alloc(5 * MiB)
assert not lib.ia_plugin_device_expandable(0)
assert lib.ia_arena_page_size(lib.ia_plugin_arena(0, lib.IA_POOL_LARGE)) == 0
assert stats(lib.IA_POOL_LARGE).capacity == 20 * MiB
print("ok")
""", expandable=0)


def test_graph_pools_keep_regions_and_nothing_is_unmapped_while_a_capture_runs():
    plugin("""
eager = alloc(8 * MiB, s=3)
free(eager)
pool = ffi.new("ia_pool_id_t *"); pool.first = 1
assert lib.ia_graph_begin(0, pool[0]) == lib.IA_OK
assert lib.ia_host_capture_begin(7, 1)
g = alloc(5 * MiB, s=7, p=pool)          # from the graph's own arena: a 20 MiB region
infos = ffi.new("ia_graph_pool_info_t[]", 4)
assert lib.ia_graph_pools(0, infos, 4) == 1 and infos[0].capacity == 20 * MiB
lib.ia_torch_empty_cache()               # a capture runs: nothing goes back
assert stats(lib.IA_POOL_LARGE).capacity == 8 * MiB
side = alloc(3 * MiB, s=4)               # eager growth while capturing maps pages, as cudaMalloc would
lib.ia_host_capture_end(7)
assert lib.ia_graph_end(0, pool[0]) == lib.IA_OK
check()
free(side)
lib.ia_torch_empty_cache()
assert stats(lib.IA_POOL_LARGE).capacity == 0
free(g)
assert lib.ia_graph_release(0, pool[0]) == lib.IA_OK
check()
print("ok")
""")


def test_a_request_wider_than_the_pools_range_says_so():
    done = run_python(PLUGIN.format(expandable=1, address_range=64 << 20) + """
alloc(100 * MiB)
print("returned")
""")
    assert done.returncode != 0 and "returned" not in done.stdout
    assert "No gap of its 64.00 MiB address range can take it" in done.stderr, done.stderr
    assert "general large pool" in done.stderr and "mapped in 2.00 MiB pages" in done.stderr


def test_the_report_says_which_pools_map(tmp_path):
    report = tmp_path / "report.json"
    plugin(f"""
alloc(5 * MiB)
assert lib.ia_plugin_write_report({str(report)!r}.encode())
print("ok")
""")
    import json
    data = json.loads(report.read_text())
    assert data["devices"][0]["expandable"] is True
    pools = {p["pool"]: p for p in data["devices"][0]["pools"]}
    assert pools["large"]["stats"]["capacity"] == 6 * MiB


def test_peer_devices_are_granted_the_mapped_pages_before_and_after_the_pools_exist():
    plugin("""
assert lib.ia_torch_enable_peer_access(3, 0) == lib.IA_OK      # device 0's pools do not exist yet
x = alloc(5 * MiB)
c = ffi.new("ia_mapping_counters_t *")
def peers():
    seen = []
    for pool in (lib.IA_POOL_SMALL, lib.IA_POOL_LARGE):
        lib.ia_host_mapping_counters(lib.ia_arena_backend(lib.ia_plugin_arena(0, pool)), c)
        seen.append(c.peers)
    return seen
assert peers() == [1 << 3, 1 << 3]
assert lib.ia_torch_enable_peer_access(5, 0) == lib.IA_OK      # and once they do
assert peers() == [(1 << 3) | (1 << 5)] * 2
assert lib.ia_torch_enable_peer_access(-1, 0) == lib.IA_ERR_INVALID_ARGUMENT
assert lib.ia_torch_entry_points().enable_peer_access(5, 0) == lib.IA_OK
print("ok")
""")


# -- the GPU failures of plugin/test_expandable.py, replayed over the host simulation -------------
# (The diagnosis of run 50: docs/vmm-gpu-failures.md at commit 26e5e45.) Each replays what the failing GPU test asked of the pools, with the
# host mapping backend's 2 MiB pages in place of the driver's, and shows the figure the GPU run
# reported coming out of a release that did unmap every whole free page: the tests measured after
# something else was allocated, or kept a tensor live, not a release that left pages mapped.

def test_gpu_empty_cache_figure_182_mib_is_the_loop_variable_keeping_the_70_mib_tensor_live():
    plugin("""
total = lambda: lib.ia_plugin_device_totals(0).capacity.current
keep = alloc(12 * MiB)
ts = [alloc(n * MiB) for n in (30, 50, 70)]
small = [alloc(4000) for _ in range(100)]
t = ts[-1]                               # `for t in ts: t.fill_(7)` leaves t bound to the 70 MiB tensor
for p in ts[:-1] + small:                # `del ts, small` frees the others only
    free(p)
lib.ia_torch_empty_cache()
assert stats(lib.IA_POOL_LARGE).capacity == (12 + 70) * MiB and stats(lib.IA_POOL_SMALL).capacity == 0
again = alloc(100 * MiB)                 # 80 MiB hole between keep and t: mapped after t instead
assert total() == 190840832, total()     # the GPU run's "after", measured once `again` was mapped
free(t)
free(again)
lib.ia_torch_empty_cache()
assert stats(lib.IA_POOL_LARGE).capacity == 12 * MiB and total() == 12 * MiB   # keep's pages only
check()
print("ok")
""")


def test_gpu_unmapped_figure_62_mib_is_a_small_page_mapped_by_the_reduction_after_the_release():
    plugin("""
total = lambda: lib.ia_plugin_device_totals(0).capacity.current
x = alloc(64 * MiB)
y = alloc(64 * MiB, s=5)                 # y = x * 2 on the side stream
lib.ia_torch_record_stream(ffi.cast("void *", x), ffi.cast("void *", 5))
free(x)
reserved = total()
lib.ia_torch_empty_cache()
assert reserved - total() == 64 * MiB    # the whole block went, once the side stream was done
m = alloc(4)                             # y.min(): its one-element result maps a small page
assert reserved - total() == 62 * MiB    # the GPU run's figure, measured after y.min()
free(m); free(y)
check()
print("ok")
""")


def test_gpu_graph_figure_44_mib_is_the_graph_pool_region_of_the_captured_output():
    plugin("""
total = lambda: lib.ia_plugin_device_totals(0).capacity.current
x = alloc(64 * MiB, s=3)
static = alloc(4 * MiB, s=3)
state = alloc(1000, s=3)                 # small tensors live through the capture (a small page)
pool = ffi.new("ia_pool_id_t *"); pool.first = 1
assert lib.ia_graph_begin(0, pool[0]) == lib.IA_OK
assert lib.ia_host_capture_begin(7, 1)
free(x)
before = total()
lib.ia_torch_empty_cache()
assert total() == before == 70 * MiB     # the GPU run's "before" and "during"
out = alloc(4 * MiB, s=7, p=pool)        # out = static * 3: a 20 MiB region of the graph's pool
lib.ia_host_capture_end(7)
assert lib.ia_graph_end(0, pool[0]) == lib.IA_OK
mid = total()
lib.ia_torch_empty_cache()
assert stats(lib.IA_POOL_LARGE).capacity == 4 * MiB and mid - total() == 64 * MiB
assert before - total() == 44 * MiB      # the GPU run's before - after: 64 MiB less the graph region
free(out); free(static); free(state)
assert lib.ia_graph_release(0, pool[0]) == lib.IA_OK
check()
print("ok")
""")
