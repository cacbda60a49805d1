"""CUDA graph pools in the C core, on the host backend: the plugin serves device 0 from host memory,
and the host backend simulates capture with CUDA's rules and counts every break of them (an event
queried or waited on across a capture's edge, a reservation given back while a stream captures).

Each test runs in a fresh interpreter, since the plugin is configured once per process. Every
test ends by asserting that no capture rule was broken and that every pool arena's invariants
hold."""

import pytest

from tests.support import run_python

PRELUDE = """
import types
from alloc._lib import ffi, lib
from alloc.arena import stats_dict

c = ffi.new("ia_plugin_config_t *")
c.budget, c.alignment, c.unified, c.host_memory = 64 << 20, 256, 0, 1
assert lib.ia_plugin_configure(c) == lib.IA_OK
MiB = 1 << 20


def pool(first, second=0):
    p = ffi.new("ia_pool_id_t *")
    p.first, p.second = first, second
    return p


def stream(s):
    return ffi.cast("void *", s)


def alloc(size, s, p=None):
    return int(ffi.cast("uintptr_t", lib.ia_torch_alloc(size, 0, stream(s), p if p is not None else ffi.NULL)))


def free(ptr):
    lib.ia_torch_free(ffi.cast("void *", ptr))


def live(p):
    n = lib.ia_graph_blocks(0, p[0], ffi.NULL, 0)
    blocks = ffi.new("ia_block_info_t[]", n)
    assert lib.ia_graph_blocks(0, p[0], blocks, n) == n
    return sorted(int(b.address) for b in blocks if not b.is_free)


def info(p):
    infos = ffi.new("ia_graph_pool_info_t[]", 16)
    n = lib.ia_graph_pools(0, infos, 16)
    found = [i for i in infos[0:n] if (i.first, i.second) == (p.first, p.second)]
    return found[0] if found else None


def eager_stats():
    # the device statistics, flat as alloc.Arena.stats() gives them, by attribute
    s = ffi.new("ia_stats_t *")
    lib.ia_plugin_device_stats(0, s)
    return types.SimpleNamespace(**stats_dict(s))


def capture(p, s, capture_id):
    assert lib.ia_graph_begin(0, p[0]) == lib.IA_OK
    assert lib.ia_host_capture_begin(s, capture_id)


def end_capture(p, s):
    lib.ia_host_capture_end(s)
    assert lib.ia_graph_end(0, p[0]) == lib.IA_OK


def check(*pools):
    msg = ffi.new("char[]", 512)
    for p in pools:
        assert lib.ia_graph_check(0, p[0], msg, 512), ffi.string(msg)
    for a in range(3):
        arena = lib.ia_plugin_arena(0, a)
        if arena != ffi.NULL:
            assert lib.ia_arena_check(arena, msg, 512), ffi.string(msg)
    assert lib.ia_host_capture_violations() == 0, lib.ia_host_capture_violations()
"""


def run(body: str) -> None:
    done = run_python(PRELUDE + body + "\nprint('ok')\n")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_a_capture_allocates_from_its_own_pool_and_reuses_within_it():
    run("""
eager = alloc(4096, 1)
free(eager)
p = pool(1)
capture(p, 2, 100)
a = alloc(4096, 2, p)
b = alloc(3 * MiB, 2, p)
assert a != eager and live(p) == sorted([a, b])
free(a)
assert alloc(4096, 2, p) == a        # freed inside the capture: the capture reuses it
end_capture(p, 2)
assert info(p).use_count == 1 and info(p).capacity >= 3 * MiB
# While the graph lives, eager code never gets its memory.
eager_blocks = [alloc(4096, 2) for _ in range(64)] + [alloc(3 * MiB, 2) for _ in range(4)]
assert not set(eager_blocks) & {a, b}
check(p)
""")


def test_graphs_sharing_a_pool_reuse_in_capture_order_and_the_last_release_gives_it_back():
    run("""
p = pool(0, 7)                        # a graph_pool_handle(): the second half set
capture(p, 3, 1)
x = alloc(8 * MiB, 3, p)
free(x)                               # freed in graph 1: graph 2 may reuse it
end_capture(p, 3)
capture(p, 3, 2)
y = alloc(8 * MiB, 3, p)
end_capture(p, 3)
assert y == x and info(p).use_count == 2
held = eager_stats().capacity
free(y)                               # graph 2's output dies; the pool still lives
assert lib.ia_graph_release(0, p[0]) == lib.IA_OK
assert info(p).use_count == 1 and eager_stats().capacity == held
assert lib.ia_graph_release(0, p[0]) == lib.IA_OK
assert info(p) is None and eager_stats().capacity < held
assert lib.ia_graph_release(0, p[0]) == lib.IA_ERR_INVALID_ARGUMENT   # below zero
assert lib.ia_graph_end(0, p[0]) == lib.IA_ERR_INVALID_ARGUMENT       # end without begin
assert lib.ia_graph_use_count(0, p[0]) == 0
check()
""")


def test_a_released_pool_keeps_a_live_output_until_it_is_freed():
    run("""
p = pool(2)
capture(p, 4, 1)
out = alloc(30 * MiB, 4, p)
end_capture(p, 4)
before = eager_stats().capacity
assert lib.ia_graph_release(0, p[0]) == lib.IA_OK
assert info(p) is not None and info(p).in_use == 30 * MiB   # the output is still someone's tensor
free(out)
assert info(p) is None and eager_stats().capacity <= before - 30 * MiB
check()
""")


def test_a_block_of_a_released_pool_freed_inside_another_capture_lives_as_long_as_that_graph():
    # PyTorch's test_graph_capture_reset_recapture: graph 1's output outlives its reset(), graph 2
    # writes it and rebinds the name inside its capture, so the block is freed while graph 2
    # captures, and graph 2's replays still write it.
    run("""
p1, p2 = pool(11), pool(12)
capture(p1, 5, 1)
out = alloc(30 * MiB, 5, p1)
end_capture(p1, 5)
assert lib.ia_graph_release(0, p1[0]) == lib.IA_OK       # graph 1 reset; out still alive
capture(p2, 5, 2)
new = alloc(30 * MiB, 5, p2)
free(out)                                                 # rebound inside graph 2's capture
end_capture(p2, 5)
assert info(p1) is not None and info(p1).capacity >= 30 * MiB   # graph 2 still uses it
lib.ia_torch_empty_cache()
assert info(p1) is not None and info(p1).capacity >= 30 * MiB
assert out not in [alloc(30 * MiB, 5) for _ in range(3)]  # never handed to eager code
free(new)
assert lib.ia_graph_release(0, p2[0]) == lib.IA_OK       # graph 2 reset: both pools go
assert info(p1) is None and info(p2) is None
check()
""")


def test_pools_that_keep_each_other_both_go_once_their_graphs_are_gone():
    run("""
p1, p2 = pool(21), pool(22)
capture(p1, 6, 1)
a = alloc(4 * MiB, 6, p1)
end_capture(p1, 6)
capture(p2, 7, 2)
b = alloc(4 * MiB, 7, p2)
free(a)                       # p2 keeps p1
end_capture(p2, 7)
capture(p1, 6, 3)
free(b)                       # p1 keeps p2
end_capture(p1, 6)
for _ in range(2):            # each capture holds its pool once: p1's two graphs go
    assert lib.ia_graph_release(0, p1[0]) == lib.IA_OK
assert info(p1) is not None   # p2's graph may still touch a
assert lib.ia_graph_release(0, p2[0]) == lib.IA_OK
assert info(p1) is None and info(p2) is None
check()
""")


def test_frees_that_would_touch_a_capturing_stream_wait_for_the_end_of_the_capture():
    run("""
on_capturing = alloc(4096, 5)
shared = alloc(4096, 6)
assert lib.ia_arena_record_stream(lib.ia_plugin_arena(0, 1), ffi.cast("void *", shared), 9) == lib.IA_OK
plain = alloc(4096, 6)
p = pool(3)
capture(p, 5, 1)
in_use = eager_stats().blocks
free(on_capturing)                    # its stream captures: an eager reuse would record on it
free(shared)                          # another stream was recorded on it
free(plain)                           # neither: freed at once
assert eager_stats().blocks == in_use - 1
end_capture(p, 5)
assert eager_stats().blocks == in_use - 3
check(p)
""")


def test_no_event_is_ever_recorded_on_a_capturing_stream():
    # A block freed on stream 10 before its capture; another stream takes it while 10 captures.
    # The event that orders the reuse was recorded when the capture began, outside it.
    run("""
blocks = [alloc(64 << 10, 10) for _ in range(8)]
for b in blocks:
    free(b)
p = pool(4)
capture(p, 10, 1)
taken = [alloc(64 << 10, 11) for _ in range(8)]
assert set(taken) & set(blocks)
end_capture(p, 10)
check(p)
""")


def test_a_workspace_inside_a_capture_is_carved_from_the_workspace_arena_and_kept_by_the_graph():
    run("""
lib.ia_workspace_enter()
first = alloc(16 * MiB, 12)           # eager workspace, freed on stream 12
free(first)
p = pool(5)
capture(p, 13, 1)                     # the capture's stream is ordered after stream 12
w1 = alloc(16 * MiB, 13, p)
assert w1 == first
free(w1)
w2 = alloc(12 * MiB, 13, p)           # the graph's later workspace reuses its own block
assert w2 == w1
end_capture(p, 13)
lib.ia_workspace_exit()
arena = lib.ia_plugin_arena(0, 0)
s = ffi.new("ia_stats_t *")
lib.ia_arena_stats(arena, s)
assert info(p).workspace == 16 * MiB and s.in_use.current == 16 * MiB and s.largest_free == 48 * MiB
check(p)
free(w2)
assert lib.ia_graph_release(0, p[0]) == lib.IA_OK
lib.ia_arena_stats(arena, s)
assert info(p) is None and s.in_use.current == 0 and s.largest_free == 64 * MiB
check()
""")


def test_a_capturing_stream_waits_for_an_outside_free_on_the_host():
    # Arena level, events left pending: the capture may not wait on the outside event itself.
    run("""
backend = ffi.new("ia_backend_t **")
assert lib.ia_host_backend_create(0, backend) == lib.IA_OK
lib.ia_host_set_auto_complete(backend[0], False)
opts = ffi.new("ia_arena_options_t *")
lib.ia_arena_default_options(opts)
opts.capacity = 4 * MiB
arena = ffi.new("ia_arena_t **")
assert lib.ia_arena_create(opts, backend[0], arena) == lib.IA_OK
out = ffi.new("void **")
assert lib.ia_arena_alloc(arena[0], MiB, 50, out) == lib.IA_OK
assert lib.ia_arena_free(arena[0], out[0], 50) == lib.IA_OK
assert lib.ia_host_capture_begin(51, 1)
assert lib.ia_arena_alloc(arena[0], MiB, 51, out) == lib.IA_OK
lib.ia_host_capture_end(51)
assert lib.ia_host_capture_host_waits() == 1 and lib.ia_host_waits(backend[0], 51, 50) == 0
assert lib.ia_host_capture_violations() == 0
lib.ia_arena_destroy(arena[0])
""")


def test_nothing_goes_back_to_the_backend_while_a_stream_captures():
    run("""
for size in (4096, 30 * MiB):
    free(alloc(size, 14))
p = pool(6)
capture(p, 15, 1)
lib.ia_torch_empty_cache()            # a cudaFree now would break the capture
held = eager_stats().capacity
assert held >= 30 * MiB
end_capture(p, 15)
lib.ia_torch_empty_cache()
assert eager_stats().capacity < held
check()
""")


def test_a_checkpoint_restores_the_pool_blocks_at_their_addresses():
    run("""
p = pool(7)
capture(p, 16, 1)
a, b, c = alloc(1 * MiB, 16, p), alloc(5 * MiB, 16, p), alloc(7 * MiB, 16, p)
end_capture(p, 16)
n = lib.ia_graph_blocks(0, p[0], ffi.NULL, 0)
saved = ffi.new("ia_block_info_t[]", n)
lib.ia_graph_blocks(0, p[0], saved, n)
free(b)
capture(p, 16, 2)
d = alloc(2 * MiB, 16, p)
end_capture(p, 16)
assert live(p) == sorted([a, c, d])
assert lib.ia_graph_restore(0, p[0], saved, n) == lib.IA_OK
assert live(p) == sorted([a, b, c])
check(p)
""")


def test_the_device_stats_count_graph_pools_once():
    run("""
eager = alloc(3 * MiB, 17)
p = pool(8)
capture(p, 18, 1)
g = alloc(3 * MiB, 18, p)
end_capture(p, 18)
s = eager_stats()
totals = lib.ia_plugin_device_totals(0)
assert s.in_use == totals.in_use.current == 6 * MiB and s.capacity == totals.capacity.current
assert info(p).in_use == 3 * MiB and info(p).streams == 1
check(p)
""")


@pytest.mark.parametrize("threads", [4])
def test_threads_allocating_eagerly_while_graphs_are_captured_keep_their_data(threads):
    # Canaries: each eager block is filled with its own byte and checked before its free, while
    # one thread captures, replays (no-op on the host) and releases graphs over and over.
    run(f"""
import random, threading
errors = []

def eager(seed):
    rng = random.Random(seed)
    held = []
    for step in range(3000):
        if held and rng.random() < 0.5:
            ptr, size, byte = held.pop(rng.randrange(len(held)))
            view = ffi.buffer(ffi.cast("char *", ptr), size)
            if view[:] != bytes([byte]) * size:
                errors.append("canary of %#x broken" % ptr)
            free(ptr)
        else:
            size = rng.choice([512, 4096, 100000, 3 * MiB])
            ptr = alloc(size, 20 + seed % 2)
            byte = rng.randrange(256)
            ffi.memmove(ffi.cast("char *", ptr), bytes([byte]) * size, size)
            held.append((ptr, size, byte))
    for ptr, size, byte in held:
        free(ptr)

def grapher():
    for i in range(200):
        p = pool(1000 + i)
        capture(p, 30, i + 1)
        outs = [alloc(s, 30, p) for s in (4096, 2 * MiB, 12 * MiB)]
        free(outs[0])
        end_capture(p, 30)
        for o in outs[1:]:
            free(o)
        assert lib.ia_graph_release(0, p[0]) == lib.IA_OK

workers = [threading.Thread(target=eager, args=(i,)) for i in range({threads})]
workers.append(threading.Thread(target=grapher))
for w in workers:
    w.start()
for w in workers:
    w.join()
assert not errors, errors[:3]
infos = ffi.new("ia_graph_pool_info_t[]", 4)
assert lib.ia_graph_pools(0, infos, 4) == 0
assert eager_stats().in_use == 0
check()
""")


def test_an_out_of_memory_in_a_graph_pool_names_the_pool():
    done = run_python(PRELUDE.replace("c.host_memory = 64 << 20, 256, 0, 1",
                                      "c.host_memory = 64 << 20, 256, 0, 1\nfrom alloc import shims\n"
                                      "c.raise_oom = ffi.cast('void (*)(const char *)', shims.raise_oom_address())")
                      + """
p = pool(9, 0)
capture(p, 40, 1)
lib.ia_workspace_enter()
alloc(100 * MiB, 40, p)
print("returned")
""")
    assert "returned" not in done.stdout and "c10::OutOfMemoryError" in done.stderr, done.stderr
    assert "while capturing into CUDA graph pool (9, 0) does not fit" in done.stderr, done.stderr


def test_the_memory_report_lists_graph_pools_apart(tmp_path):
    path = tmp_path / "report.json"
    run(f"""
import json
from arena_tools import report
eager = alloc(3 * MiB, 60)
p = pool(11)
capture(p, 61, 1)
g = alloc(30 * MiB, 61, p)
lib.ia_workspace_enter()
w = alloc(4 * MiB, 61, p)
lib.ia_workspace_exit()
end_capture(p, 61)
assert lib.ia_plugin_write_report({str(path)!r}.encode())
r = report.check_report(json.load(open({str(path)!r})))
[dev] = r["devices"]
assert dev["graph_pools"] == [{{"id": [11, 0], "use_count": 1, "capacity": 34 * MiB,
                                "in_use": 34 * MiB, "workspace": 4 * MiB}}], dev["graph_pools"]
rows = {{s["pool"]: s for s in report.summarize(r)}}
assert rows["graph (11, 0) large"]["in_use"] == 30 * MiB      # the carve-out is the workspace pool's
assert rows["workspace"]["in_use"] == 4 * MiB and rows["large"]["in_use"] == 3 * MiB
""")


def test_a_pool_with_its_own_allocator_takes_its_regions_from_it_until_the_pool_is_gone():
    # torch.cuda.MemPool(allocator): vLLM's sleep mode, NCCL's symmetric memory
    run("""
import ctypes
calls = {"alloc": [], "free": [], "drop": 0}
keep = {}
@ffi.callback("void *(void *, size_t, int, void *)")
def own_alloc(ctx, size, device, stream):
    buf = ctypes.create_string_buffer(size + 4096)
    base = (ctypes.addressof(buf) + 4095) & ~4095
    keep[base] = buf
    calls["alloc"].append(size)
    return ffi.cast("void *", base)
@ffi.callback("void (void *, void *, size_t, int, void *)")
def own_free(ctx, ptr, size, device, stream):
    calls["free"].append(size)
    del keep[int(ffi.cast("uintptr_t", ptr))]
@ffi.callback("void (void *)")
def drop(ctx):
    calls["drop"] += 1
own = ffi.new("ia_pool_allocator_t *", {"alloc": own_alloc, "free": own_free, "drop": drop})
p = pool(0, 41)
assert lib.ia_graph_set_allocator(0, p[0], own) == lib.IA_OK
assert lib.ia_graph_incref(0, p[0]) == lib.IA_OK         # the MemPool
assert lib.ia_graph_begin(0, p[0]) == lib.IA_OK          # use_mem_pool
x = alloc(4 * MiB, 3, p)
y = alloc(4096, 3, p)
assert lib.ia_graph_end(0, p[0]) == lib.IA_OK
assert lib.ia_graph_release(0, p[0]) == lib.IA_OK
assert sorted(calls["alloc"]) == [2 * MiB, 20 * MiB]     # PyTorch's segment sizes
assert int(ffi.cast("uintptr_t", ffi.cast("void *", x))) in range(min(keep), max(keep) + 20 * MiB)
assert lib.ia_graph_set_allocator(0, p[0], own) == lib.IA_ERR_INVALID_ARGUMENT   # it has allocated
assert lib.ia_graph_release(0, p[0]) == lib.IA_OK        # the MemPool goes; x and y live on
assert calls["free"] == [] and calls["drop"] == 0
free(x); free(y)
assert sorted(calls["free"]) == [2 * MiB, 20 * MiB] and calls["drop"] == 1 and not keep
check()
""")


def test_a_no_split_pool_hands_out_whole_blocks():
    run("""
p = pool(0, 42)
assert lib.ia_graph_set_no_split(0, p[0]) == lib.IA_OK
assert lib.ia_graph_incref(0, p[0]) == lib.IA_OK
assert lib.ia_graph_begin(0, p[0]) == lib.IA_OK
a, b = alloc(4 * MiB, 3, p), alloc(4 * MiB, 3, p)
assert lib.ia_graph_end(0, p[0]) == lib.IA_OK
n = lib.ia_graph_blocks(0, p[0], ffi.NULL, 0)
blocks = ffi.new("ia_block_info_t[]", n)
lib.ia_graph_blocks(0, p[0], blocks, n)
assert [(b.is_free, b.size) for b in blocks] == [(False, 20 * MiB)] * 2   # a segment each, no rest
free(a); free(b)
check(p)
""")


def test_an_eager_request_that_finds_no_memory_takes_a_free_block_of_a_use_on_oom_pool():
    # The general pools map a 64 MiB range each, so an eager request past it finds no memory.
    done = run_python(PRELUDE.replace("c.host_memory = 64 << 20, 256, 0, 1",
                                      "c.host_memory = 64 << 20, 256, 0, 1\n"
                                      "c.expandable, c.address_range = 1, 64 << 20") + """
use, other = pool(0, 43), pool(0, 44)
blocks = {}
for q, on in ((use, True), (other, False)):
    assert lib.ia_graph_incref(0, q[0]) == lib.IA_OK       # a MemPool
    assert lib.ia_graph_set_use_on_oom(0, q[0], on) == lib.IA_OK
    assert lib.ia_graph_begin(0, q[0]) == lib.IA_OK
    blocks[on] = alloc(40 * MiB, 3, q)
    free(blocks[on])                                      # a free 40 MiB block stays in each
    assert lib.ia_graph_end(0, q[0]) == lib.IA_OK
big = alloc(60 * MiB, 3)                                  # the large pool's range is nearly full
c = alloc(30 * MiB, 3)
assert c == blocks[True], (c, blocks)                     # the use_on_oom pool's block, not the other's
free(c)
assert lib.ia_graph_set_use_on_oom(0, use[0], False) == lib.IA_OK   # as the MemPool's destructor does
assert lib.ia_graph_release(0, use[0]) == lib.IA_OK
free(big)
check(use, other)
print("ok")
""")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_a_pools_empty_cache_gives_back_its_free_regions_and_no_one_elses():
    run("""
p = pool(0, 45)
assert lib.ia_graph_incref(0, p[0]) == lib.IA_OK       # a MemPool, held
assert lib.ia_graph_begin(0, p[0]) == lib.IA_OK
kept, gone = alloc(4 * MiB, 3, p), alloc(30 * MiB, 3, p)
assert lib.ia_graph_end(0, p[0]) == lib.IA_OK
free(gone)
free(alloc(30 * MiB, 3))                                # an eager region, now free
eager = eager_stats().capacity
held = info(p).capacity
lib.ia_graph_empty_cache(0, p[0])
assert info(p).capacity == held - 30 * MiB and info(p).in_use == 4 * MiB
assert eager_stats().capacity == eager - 30 * MiB       # only the pool's region went
free(kept)
check(p)
""")
