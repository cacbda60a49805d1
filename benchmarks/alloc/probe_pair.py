"""Where a torch.empty + del pair spends its time, under PyTorch's allocator and the process scope:
C++ loops (no Python) over the allocator's allocate() + free (bench_torch_alloc's C++ row),
at::empty, the device and stream lookups an allocator makes, and (arena) the core's entry points
alone; Python's torch.empty + del (bench_torch_alloc's one-thread row) beside them. Each allocator
in fresh processes, alternated, pinned as bench_torch_alloc pins them; ns per operation, each the
best of 5 loops, then the median of the rounds. The started-thread rows (added after run 97) time
the pair from a thread other than the main one, from Python and from C++, before and after that
thread launched a kernel; the four-thread row is bench_torch_alloc's (4 KiB), its threads
launching a kernel first (as they do there since run 102) and not.

    python benchmarks/alloc/probe_pair.py [ROUNDS] [default,arena,arena@DIR]

arena@DIR runs the process scope of the checkout at DIR (its alloc/ built), to set two versions
of the allocator side by side."""
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
SRC = r'''
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <chrono>
using clk = std::chrono::steady_clock;
static double ns(clk::time_point a, clk::time_point b, long n) {
  return std::chrono::duration<double, std::nano>(b - a).count() / n;
}
double empty_ns(long size, long n) {
  auto o = at::TensorOptions().dtype(at::kByte).device(at::kCUDA);
  auto a = clk::now();
  for (long i = 0; i < n; i++) { auto t = at::empty({size}, o); }
  return ns(a, clk::now(), n);
}
double device_ns(long n) {
  volatile int s = 0; auto a = clk::now();
  for (long i = 0; i < n; i++) s += c10::cuda::current_device();
  return ns(a, clk::now(), n);
}
double stream_ns(long n) {
  volatile long s = 0; auto a = clk::now();
  for (long i = 0; i < n; i++) s += (long)c10::cuda::getCurrentCUDAStream().stream();
  return ns(a, clk::now(), n);
}
double profiling_ns(long n) {
  volatile int s = 0; auto a = clk::now();
  for (long i = 0; i < n; i++) s += c10::memoryProfilingEnabled();
  return ns(a, clk::now(), n);
}
double roundup_ns(long n) {
  volatile long s = 0; auto a = clk::now();
  for (long i = 0; i < n; i++)
    s += c10::CachingAllocator::AcceleratorAllocatorConfig::roundup_power2_divisions(4096 + i % 7);
  return ns(a, clk::now(), n);
}
typedef void* (*alloc_fn)(size_t, size_t, int, void*, const void*);
typedef void (*free_fn)(void*);
double core_ns(long fa, long ff, long size, long n) {
  auto A = (alloc_fn)fa; auto F = (free_fn)ff;
  void* st = c10::cuda::getCurrentCUDAStream().stream();
  auto a = clk::now();
  for (long i = 0; i < n; i++) F(A(size, size, 0, st, nullptr));
  return ns(a, clk::now(), n);
}
'''
FUNCS = ["empty_ns", "device_ns", "stream_ns", "profiling_ns", "roundup_ns", "core_ns"]


def ext():
    """This program's loops, and bench_torch_alloc's allocate + free loop (torch_pairs.cpp)."""
    from torch.utils.cpp_extension import load_inline

    from benchmarks.alloc.bench_torch_alloc import cxx_pairs
    return load_inline("pairprobe", cpp_sources=SRC, functions=FUNCS, with_cuda=True, extra_cflags=["-O2"]), cxx_pairs()


def child(name):
    if "@" in name:  # arena@DIR: the allocator of another checkout
        sys.path.insert(0, os.path.abspath(name.split("@")[1]))
    from benchmarks.alloc.bench_torch_alloc import cpu_list, default_cpus, launch, pairs, threaded
    if default_cpus() != "none":
        os.sched_setaffinity(0, cpu_list(default_cpus()))
    import torch
    from arena_tools import allocators
    allocators.install(name.split("@")[0])
    m, cxx = ext()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    N = 200_000
    core = None
    if name.startswith("arena"):
        from alloc._core import ffi, lib
        ep = lib.ia_torch_entry_points()
        core = (int(ffi.cast("uintptr_t", ep.alloc)), int(ffi.cast("uintptr_t", ep.free)))

    def best(f, *a):
        return min(f(*a) for _ in range(5))

    def py(size, n=50_000):  # bench_torch_alloc's one-thread row: torch.empty + del from Python
        return min(pairs(torch, [size], n, 0) for _ in range(5)) / n * 1e9

    def pair_ns(size, n):  # bench_torch_alloc's C++ row: the allocator's allocate + free alone
        return cxx.pairs([size], n) / n * 1e9

    keep = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in (4096, 1 << 20, 16 << 20) for _ in range(20)]
    out = {}
    for size, label in ((4096, "4K"), (1 << 20, "1M"), (16 << 20, "16M")):
        pair_ns(size, 1000)
        m.empty_ns(size, 1000)
        out[f"python {label}"] = py(size)
        if label == "4K":  # a started thread pays about 5x the main thread's pair (RESULTS.md, run 85)
            got = {}

            def in_thread():  # Python's pair, at::empty and the allocator's pair, from one started thread
                for when in ("", ", after a kernel"):
                    got[f"python 4K, started thread{when}"] = py(size)
                    got[f"empty 4K, started thread{when}"] = best(m.empty_ns, size, N // 4)
                    got[f"pair 4K, started thread{when}"] = best(pair_ns, size, N // 4)
                    got[f"current_device, started thread{when}"] = best(m.device_ns, N // 4)
                    # A thread that never launched work may have no CUDA context current, which
                    # pairs alone never make current: is that what a started thread pays for?
                    launch(torch)
            worker = threading.Thread(target=in_thread)
            worker.start()
            worker.join()
            out.update(got)
            per = 50_000 // 4  # bench_torch_alloc's four-thread row, its fastest of 5
            for when, enter in (("", None), (", after a kernel", lambda: launch(torch))):
                out[f"python 4K, 4 threads{when}"] = min(threaded(lambda: pairs(torch, [size], per, 0), 4, enter)
                                                         for _ in range(5)) / (4 * per) * 1e9
        out[f"empty {label}"] = best(m.empty_ns, size, N)
        out[f"pair {label}"] = best(pair_ns, size, N)
        if core:
            out[f"core {label}"] = best(m.core_ns, core[0], core[1], size, N)
    out["current_device"] = best(m.device_ns, N)
    out["getCurrentCUDAStream()"] = best(m.stream_ns, N)
    out["memoryProfilingEnabled"] = best(m.profiling_ns, N)
    out["roundup_power2_divisions"] = best(m.roundup_ns, N)
    del keep
    print("RESULT " + json.dumps({"allocator": name, "ns": out}), flush=True)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        return child(sys.argv[2])
    t0 = time.time()
    ext()  # built once here; the children find it in PyTorch's extension cache
    print(f"built in {time.time() - t0:.0f} s", flush=True)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else ["default", "arena"]
    res = []
    for r in range(rounds):
        for name in names:
            p = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True,
                               timeout=120)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if not line:
                print(name, "failed", p.stderr[-2000:])
                continue
            res.append(json.loads(line[0][7:]))
            print(line[0], flush=True)  # as it comes: a time limit still leaves the rounds done
    rows = list(dict.fromkeys(k for r in res for k in r["ns"]))
    print(f"{'ns per op (median of rounds; each best of 5)':28s} " + " ".join(f"{n[:16]:>16s}" for n in names)
          + "   rounds")
    for row in rows:
        cols = [[r["ns"][row] for r in res if r["allocator"] == n and row in r["ns"]] for n in names]
        med = [f"{statistics.median(c):16.1f}" if c else f"{'-':>16s}" for c in cols]
        print(f"{row:28s} " + " ".join(med) + "   " + " / ".join(" ".join(f"{x:.0f}" for x in c) for c in cols))


if __name__ == "__main__":
    main()
