"""PyTorch's memory tools under the process scope, on a real GPU: memory history and snapshots
(and what torch.cuda._memory_viz draws from them), the memory fraction, accumulated statistics,
the out-of-memory error's words and observers, the profiler's memory events, and MemPools with an
allocator of their own, no_split or use_on_oom.

Each case runs in a fresh interpreter under PyTorch's own allocator and under ``alloc.install()``
and prints what it observed; the two must print the same."""

import pytest

from tests.support.gpu import run

pytestmark = pytest.mark.gpu


def both(body: str, timeout: float = 300) -> dict:
    default = run("ARENA = False\n" + body, timeout=timeout)
    ours = run("ARENA = True\nalloc.install(alloc.Config(budget_mb=64))\n" + body, timeout=timeout)
    assert ours == default, (ours, default)
    return ours


def test_history_and_snapshots_name_the_code_that_allocated_and_the_viz_draws_them():
    both("""
import pickle, tempfile
from torch.cuda import _memory_viz
torch.cuda.memory._record_memory_history("all", context="all", stacks="python")
def the_allocation():
    return torch.randn(311, 411, device="cuda")
def the_free(t):
    del t
x = the_allocation()
the_free(the_allocation())
ss = torch.cuda.memory._snapshot()
blocks = [b for s in ss["segments"] for b in s["blocks"] if b["requested_size"] == 311 * 411 * 4]
trace = ss["device_traces"][0]
actions = [e["action"] for e in trace]
text = str(ss)
segment = [s for s in ss["segments"] if any(b["address"] == x.data_ptr() for b in s["blocks"])]
with tempfile.NamedTemporaryFile(suffix=".pickle") as f:
    pickle.dump(ss, f)
    f.flush()
    plots = [len(_memory_viz.trace_plot(ss)) > 1000, len(_memory_viz.segment_plot(ss)) > 1000]
out = {
    "live_block_frames": any("the_allocation" in str(b["frames"]) for b in blocks if b["state"] == "active_allocated"),
    "alloc_then_free": actions.index("alloc") < actions.index("free_requested"),
    "free_stack": "the_free" in text,
    "segment_holds_x": len(segment) == 1 and segment[0]["total_size"] >= x.nbytes,
    "sizes": str(311 * 411 * 4) in text,
    "plots": plots,
}
del x
torch.cuda.empty_cache()
out["empty_cache_gives_back"] = torch.cuda.memory._snapshot()["device_traces"][0][-1]["action"] in (
    "segment_free", "segment_unmap")
torch.cuda.memory._record_memory_history(None)
torch.cuda.empty_cache()
torch.empty(1 << 20, device="cuda")
out["off_records_nothing"] = torch.cuda.memory._snapshot()["device_traces"][0] == []
print(json.dumps(out))
""")


def test_history_turned_off_and_on_again_traces_the_tensors_freed_before_the_snapshot():
    # PyTorch's test_memory_plots: each round empties the cache, turns history on with other
    # options, frees its tensors before the snapshot, and turns history off again. Its
    # trace_plot(filter_freed=True) drops the freed pairs from the snapshot it is given, so the
    # size it then looks for is left only in the free block's requested_size: PyTorch's free
    # block keeps that of the last allocation freed into it.
    both("""
from torch.cuda._memory_viz import trace_plot
out = []
for context, stacks in (("all", "all"), ("all", "python"), (None, "python")):
    torch.cuda.memory.empty_cache()
    torch.cuda.memory._record_memory_history("all", context=context, stacks=stacks)
    def run():
        x = torch.rand(128, 128, device="cuda")
        x * x + x * x
    run()
    ss = torch.cuda.memory._snapshot()
    trace = ss["device_traces"][0]
    out.append({"alloc_sizes": sorted({e["size"] for e in trace if e["action"] == "alloc"}),
                "freed": sum(e["action"] == "free_completed" for e in trace),
                "frames": "run" in str([e.get("frames") for e in trace])})
    trace_plot(ss, filter_freed=True)
    out[-1]["left_after_the_filter"] = [(e["action"], e["size"]) for e in ss["device_traces"][0]
                                        if e["action"] not in ("segment_map", "segment_alloc")]
    out[-1]["a_free_block_keeps_the_size"] = any(b["requested_size"] == 128 * 128 * 4 for s in ss["segments"]
                                                 for b in s["blocks"] if b["state"] == "inactive")
    torch.cuda.memory._record_memory_history(None)
print(json.dumps(out))
""")


def test_memory_fraction_reads_back_and_bounds_what_the_process_may_hold():
    both("""
total = torch.cuda.get_device_properties(0).total_memory
out = {"initial": torch.cuda.get_per_process_memory_fraction()}
for f in (0.37, 1.0, 0.0, 0.5):
    torch.cuda.set_per_process_memory_fraction(f)
    out[str(f)] = torch.cuda.get_per_process_memory_fraction()
ok = torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda")
try:
    torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda")
    out["over"] = None
except torch.OutOfMemoryError as e:
    out["over"] = "out of memory" in str(e) and "allowed" in str(e)
torch.cuda.set_per_process_memory_fraction(1.0)
print(json.dumps(out))
""")


def test_accumulated_statistics_reset_as_pytorch_resets_them():
    both("""
keep = [torch.empty(1000, device="cuda") for _ in range(3)]
del keep[0]
torch.cuda.reset_accumulated_memory_stats()
s = torch.cuda.memory_stats()
out = {"after_reset": [s["allocation.all.allocated"], s["allocation.all.freed"], s["allocation.all.current"]]}
t = torch.empty(1000, device="cuda")
del keep[0]
s = torch.cuda.memory_stats()
out["after_more"] = [s["allocation.all.allocated"], s["allocation.all.freed"], s["allocation.all.current"]]
print(json.dumps(out))
""")


def test_torch_accelerator_reads_the_installed_allocator():
    # torch.accelerator's memory functions go through c10's allocator table, not torch.cuda's
    both("""
prev = torch.accelerator.memory_stats()
x = torch.randn(256, device="cuda")
s = torch.accelerator.memory_stats()
out = {"keys": "active_bytes.all.current" in s and "allocated_bytes.all.peak" in s,
       "active": s["active_bytes.all.current"] - prev.get("active_bytes.all.current", 0),
       "allocated": torch.accelerator.memory_allocated() == torch.cuda.memory_allocated() > 0,
       "reserved": torch.accelerator.memory_reserved() == torch.cuda.memory_reserved() > 0}
del x
torch.accelerator.empty_cache()
s = torch.accelerator.memory_stats()
out["freed"] = s["active_bytes.all.freed"] >= 1024
torch.accelerator.reset_peak_memory_stats()
out["peak"] = torch.accelerator.max_memory_allocated() == torch.cuda.memory_allocated()
print(json.dumps(out))
""")


def test_nested_mempools_each_take_their_own_allocations():
    both("""
pools = [torch.cuda.MemPool() for _ in range(3)]
data = []
def take():
    data.append(torch.empty(5 << 20, device="cuda"))
with torch.cuda.use_mem_pool(pools[0]):
    take()
    with torch.cuda.use_mem_pool(pools[1]):
        take()
        with torch.cuda.use_mem_pool(pools[2]):
            take()
        take()
    take()
def held(pool):
    return sorted(b["requested_size"] for s in torch.cuda.memory.memory_snapshot(pool.id) for b in s["blocks"]
                  if b["state"] == "active_allocated")
print(json.dumps({"held": [held(p) for p in pools]}))
""")


def test_roundup_power2_divisions_rounds_as_pytorch_and_requested_bytes_stay_the_request():
    both("""
torch.empty(1, device="cuda")  # PyTorch's allocator has no statistics before its first allocation
def grows(nbytes, settings):
    torch.cuda.memory._set_allocator_settings(settings)
    before = torch.cuda.memory_stats()
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    after = torch.cuda.memory_stats()
    return [after["active_bytes.all.allocated"] - before["active_bytes.all.allocated"],
            after["requested_bytes.all.allocated"] - before["requested_bytes.all.allocated"]]
out = {}
for n in (84 << 20, 3000, 1 << 20, 400 << 20):
    out[n] = [grows(n, ""), grows(n, "roundup_power2_divisions:4"),
              grows(n, "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]")]
torch.cuda.memory._set_allocator_settings("roundup_power2_divisions:1")
print(json.dumps(out))
""")


def test_out_of_memory_speaks_pytorchs_words_and_tells_its_observers():
    both("""
seen = []
torch._C._cuda_attach_out_of_memory_observer(lambda device, size, allowed, free: seen.append(size))
out = {}
for n in (1 << 50, 1 << 62):
    try:
        torch.empty(n, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        out[str(n)] = [str(e).startswith("CUDA out of memory. Tried to allocate "),
                       "Tried to allocate 1048576.00 GiB. GPU 0 has a total capacity of " in str(e),
                       "Tried to allocate more than 1EB memory." in str(e)]
out["observed"] = seen == [1 << 50]
x = torch.ones(10, device="cuda")
out["after"] = x.sum().item()
print(json.dumps(out))
""")


def test_the_profilers_memory_events_carry_the_allocating_code():
    both("""
with torch.profiler.profile(with_stack=True, profile_memory=True, record_shapes=True) as prof:
    x = torch.rand(128, 128, device="cuda")
    y = x * x + x * x
    del y
from torch.cuda._memory_viz import profile_plot
plot = profile_plot(prof)
events = [e for e in prof.events() if e.name == "[memory]" and e.device_type == torch.autograd.DeviceType.CUDA]
print(json.dumps({"plot": "test_memory_tools" in plot or "<string>" in plot,
                  "allocs": sum(e.cuda_memory_usage > 0 for e in events) >= 3,
                  "frees": sum(e.cuda_memory_usage < 0 for e in events) >= 1}))
""")


def test_raw_frees_reach_memory_history_as_pytorchs_do():
    # torch.cuda.caching_allocator_delete ends in the allocator's raw_delete: PyTorch's goes
    # through its free, which records the free's stack in the history as a tensor's free does.
    # The profiler sees neither end of a raw allocation under PyTorch's allocator; "profiled"
    # holds the arena to the same.
    out = both("""
torch.cuda.memory._record_memory_history("all", context="all", stacks="python")
def raw_free(p):
    torch.cuda.caching_allocator_delete(p)
with torch.profiler.profile(profile_memory=True) as prof:
    p = torch.cuda.caching_allocator_alloc(3 << 20)
    raw_free(p)
trace = torch.cuda.memory._snapshot()["device_traces"][0]
torch.cuda.memory._record_memory_history(None)
mine = [e for e in trace if e["addr"] == p and e["action"] in ("alloc", "free_requested", "free_completed")]
events = [e.cuda_memory_usage for e in prof.events()
          if e.name == "[memory]" and e.device_type == torch.autograd.DeviceType.CUDA]
print(json.dumps({"actions": [e["action"] for e in mine],
                  "freed_in": [any(f["name"] == "raw_free" for f in e["frames"]) for e in mine],
                  "profiled": [u > 0 for u in events if abs(u) >= 3 << 20]}))
""")
    assert out["actions"] == ["alloc", "free_requested", "free_completed"], out
    assert out["freed_in"][:2] == [False, True], out


ALLOCATOR_SO = r'''
#include <dlfcn.h>
#include <stddef.h>
#include <stdlib.h>
typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
int allocs = 0, frees = 0;
static void *cudart(void) {
  static void *h;
  if (!h) h = dlopen(getenv("TEST_CUDART"), RTLD_NOW | RTLD_NOLOAD);
  if (!h) h = dlopen(getenv("TEST_CUDART"), RTLD_NOW);
  return h;
}
void *my_alloc(size_t size, int device, void *stream) {
  void *p = NULL;
  allocs++;
  return ((malloc_fn)dlsym(cudart(), "cudaMalloc"))(&p, size) == 0 ? p : NULL;
}
void my_free(void *ptr, size_t size, int device, void *stream) {
  frees++;
  ((free_fn)dlsym(cudart(), "cudaFree"))(ptr);
}
'''


def test_mempools_with_their_own_allocator_no_split_and_use_on_oom(tmp_path):
    source = tmp_path / "my_alloc.c"
    source.write_text(ALLOCATOR_SO)
    both(f"""
import ctypes, subprocess, os
so = {str(tmp_path / "my_alloc.so")!r}
if not os.path.exists(so):
    subprocess.run(["cc", "-shared", "-fPIC", "-o", so, {str(source)!r}, "-ldl"], check=True)
from alloc.plugin import loaded_cudart
os.environ["TEST_CUDART"] = loaded_cudart() or "libcudart.so"
lib = ctypes.CDLL(so)
mine = torch.cuda.memory.CUDAPluggableAllocator(so, "my_alloc", "my_free")
out = {{}}
def counts():
    return [ctypes.c_int.in_dll(lib, "allocs").value > 0, ctypes.c_int.in_dll(lib, "frees").value > 0]
def f():
    pool = torch.cuda.MemPool(mine.allocator())
    with torch.cuda.use_mem_pool(pool):
        x = torch.arange(1 << 21, device="cuda")
    y = torch.arange(1 << 21, device="cuda")            # outside: not the pool's allocator
    return x, y
x, y = f()
out["after_pool_gone"] = counts()
out["x"] = x.sum().item()
del x, y
torch.cuda.empty_cache()
out["after_free"] = counts()
split, whole = torch.cuda.MemPool(), torch.cuda.MemPool(no_split=True)
for p in (split, whole):
    with torch.cuda.use_mem_pool(p):
        ts = [torch.randn(1 << 20, device="cuda") for _ in range(2)]
    out[str(p is whole)] = [len(s["blocks"]) for s in p.snapshot()]
    del ts
print(json.dumps(out))
""")
