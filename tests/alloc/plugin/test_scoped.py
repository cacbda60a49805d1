"""The workspace scope on a real GPU: the arena behind one torch.cuda.MemPool per device, with
PyTorch's own allocator serving everything else. Each test runs in a fresh interpreter."""

import subprocess

import pytest

from tests.support.gpu import ORDINARY_WORK, run

pytestmark = pytest.mark.gpu


@pytest.mark.device_wide
def test_seed_workload_stays_flat_at_the_budget_with_one_reservation():
    out = run("""
alloc.install(alloc.Config(budget_mb=512), scope="workspace")
torch.cuda.init()
free0 = torch.cuda.mem_get_info()[0]
from arena_tools.fit import seed_workload
taken, pieces = [], 0
plans = len(list(seed_workload(254_000, 3_200, 4, 512 << 20, topk=0)))
g = torch.Generator(device="cuda").manual_seed(7)
for plan in seed_workload(254_000, 3_200, 4, 512 << 20, topk=0):
    for rows in plan.pieces:
        with alloc.workspace():
            logits = torch.empty(rows, plan.width, device="cuda")
        logits.uniform_(generator=g)
        # fresh data, written whole: the last element holds what uniform_ wrote
        assert 0 <= logits[-1, -1].item() < 1
        del logits
        pieces += 1
    torch.cuda.synchronize()
    taken.append(free0 - torch.cuda.mem_get_info()[0])
s = alloc.memory_stats()
segments = alloc.pool_snapshot(0)
print(json.dumps({"taken": taken, "pieces": pieces, "plans": plans,
                  "reserves": s["arena.workspace.backend_reserves"],
                  "arena_capacity": s["arena.workspace.capacity"],
                  "segments": [seg["total_size"] for seg in segments],
                  "reserved": s["reserved_bytes.all.current"],
                  "segment_allocs": s["num_device_alloc"]}))
""")
    MiB = 1 << 20
    assert out["pieces"] > out["plans"] == len(out["taken"]) > 70, out
    assert out["reserves"] == 1 and out["arena_capacity"] == 514 * MiB, out
    assert out["segments"] == [512 * MiB], "every workspace split from the one budget segment"
    # Flat from the first chunk to the last: the arena plus PyTorch's own few MiB of the rest.
    assert max(out["taken"]) - min(out["taken"]) <= 4 * MiB, out["taken"]
    assert 514 * MiB <= min(out["taken"]) and max(out["taken"]) <= 530 * MiB
    assert out["reserved"] >= 512 * MiB  # PyTorch counts the pool's segment as reserved


def test_pytorch_keeps_serving_everything_else_with_stats_snapshots_and_graphs():
    default = run(ORDINARY_WORK + "print(json.dumps(outs))")
    out = run("""
alloc.install(alloc.Config(budget_mb=64), scope="workspace")
""" + ORDINARY_WORK + """
with alloc.workspace():
    ws = torch.empty(3000, 1000, device="cuda")
    small = torch.empty(100, device="cuda")  # a small-block request inside the scope
plain = torch.empty(1000, device="cuda")
arena = alloc.device_arena(0, "workspace")
inside = lambda t: arena.owns(t.data_ptr())
before = torch.cuda.memory_stats()
# A CUDA graph beside the pool: PyTorch's own private pool, replayed against eager results.
x = torch.randn(4096, device="cuda")
static_in = x.clone()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        y = static_in * 2 + 1
torch.cuda.current_stream().wait_stream(s)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    static_out = static_in * 2 + 1
fresh = torch.randn(4096, device="cuda")
static_in.copy_(fresh)
graph.replay()
graph_ok = torch.equal(static_out, fresh * 2 + 1)
snap = torch.cuda.memory_snapshot()
print(json.dumps({"outs": outs, "ws": inside(ws), "small": inside(small), "plain": inside(plain),
                  "graph_ok": graph_ok, "pool_is_same": alloc.workspace_pool(0) is alloc.workspace_pool(),
                  "allocated": before["allocated_bytes.all.current"],
                  "reserved": before["reserved_bytes.all.current"],
                  "snap_pool_segments": sum(1 for seg in snap if arena.owns(seg["address"])),
                  "scope": alloc.installed_scope()}))
""")
    assert out["outs"] == default
    assert out["ws"] and out["small"] and not out["plain"]
    assert out["graph_ok"] and out["pool_is_same"] and out["scope"] == "workspace"
    assert out["allocated"] >= 3000 * 1000 * 4 and out["reserved"] >= 64 << 20
    assert out["snap_pool_segments"] == 2  # the budget's segment and the small-block one


def test_over_budget_raises_out_of_memory_naming_the_budget_and_the_process_goes_on():
    out = run("""
alloc.install(alloc.Config(budget_mb=64), scope="workspace")
with alloc.workspace():
    held = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
    try:
        torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        inside = None
    except torch.OutOfMemoryError as e:
        inside = str(e)
try:
    with alloc.workspace():
        torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
    msg = None
except torch.OutOfMemoryError as e:
    msg = str(e)
del held
with alloc.workspace():
    again = torch.ones(60 << 20, dtype=torch.uint8, device="cuda")
print(json.dumps({"msg": msg, "inside": inside, "again": again.sum().item(), "ok": torch.ones(5, device="cuda").sum().item(),
                  "reserves": alloc.memory_stats()["arena.workspace.backend_reserves"]}))
""")
    inside, msg = out["inside"], out["msg"]
    # Caught inside the scope: the core's figures, raised from inside PyTorch's allocator.
    assert inside and "budget 64.00 MiB" in inside and "another segment of 40.00 MiB" in inside, inside
    # Out of the scope: PyTorch's view of the pool added.
    assert msg and msg.startswith(inside[:60]) and "40.00 MiB in use" in msg, msg
    assert "largest free block 24.00 MiB" in msg and "budget_mb" in msg
    assert out["again"] == 60 << 20 and out["ok"] == 5 and out["reserves"] == 1


def test_a_workspace_on_another_stream_is_refused_naming_both_streams():
    out = run("""
alloc.install(alloc.Config(budget_mb=32), scope="workspace")
alloc.workspace_pool(0)  # primed on the current stream
side = torch.cuda.Stream()
with torch.cuda.stream(side), alloc.workspace():
    try:
        torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
        msg = None
    except torch.OutOfMemoryError as e:
        msg = str(e)
with alloc.workspace():
    ok = torch.ones(8 << 20, dtype=torch.uint8, device="cuda")
print(json.dumps({"msg": msg, "side": hex(side.cuda_stream), "ok": ok.sum().item()}))
""")
    assert out["msg"] and out["side"] in out["msg"] and "one stream" in out["msg"]
    assert out["ok"] == 8 << 20


def test_one_scope_per_process_and_one_pool_per_device():
    out = run("""
alloc.install(scope="workspace")
errors = []
for call in (lambda: alloc.install(), lambda: alloc.install(scope="nowhere")):
    try:
        call()
    except alloc.InstallError as e:
        errors.append(str(e))
p = alloc.workspace_pool(0)
assert alloc.install(scope="workspace") == alloc.installed_config()  # the same again: nothing
print(json.dumps({"errors": errors, "same": p is alloc.workspace_pool(torch.device("cuda:0"))}))
""")
    assert "already installed in workspace scope" in out["errors"][0]
    assert "unknown scope 'nowhere'" in out["errors"][1] and out["same"]
    out = run("""
alloc.install()
try:
    alloc.install(scope="workspace")
except alloc.InstallError as e:
    msg = str(e)
try:
    alloc.workspace_pool(0)
except alloc.InstallError as e:
    pool_msg = str(e)
print(json.dumps({"msg": msg, "pool_msg": pool_msg}))
""")
    assert "already installed in process scope" in out["msg"]
    assert 'install(scope="workspace")' in out["pool_msg"]


def test_workspace_scope_installs_after_cuda_started_and_refuses_max_split():
    out = run("""
x = torch.ones(10, device="cuda")
alloc.install(alloc.Config(budget_mb=32), scope="workspace")
with alloc.workspace():
    y = torch.ones(1 << 20, device="cuda")
print(json.dumps({"y": y.sum().item(), "x": x.sum().item()}))
""")
    assert out == {"y": 1 << 20, "x": 10}
    out = run("""
try:
    alloc.install(scope="workspace")
except alloc.InstallError as e:
    msg = str(e)
print(json.dumps({"msg": msg}))
""", env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})
    assert "max_split_size_mb" in out["msg"]


def test_unified_guard_refuses_the_one_reservation_early(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {128 << 20} kB\nMemAvailable: {256 << 10} kB\n")  # 256 MiB
    out = run(f"""
alloc.install(alloc.Config(budget_mb=512, unified="on", host_headroom_mb=0,
                           meminfo={str(meminfo)!r}), scope="workspace")
t0 = time.perf_counter()
try:
    with alloc.workspace():
        torch.empty(1 << 20, device="cuda")
except torch.OutOfMemoryError as e:
    msg = str(e)
print(json.dumps({{"msg": msg, "s": time.perf_counter() - t0, "unified": alloc.device_is_unified(0),
                  "ok": torch.ones(3, device="cuda").sum().item()}}))
""")
    assert "unified memory" in out["msg"] and "budget_mb" in out["msg"]
    assert out["unified"] and out["ok"] == 3 and out["s"] < 1.0


TINY_ALLOCATOR = r"""
#include <dlfcn.h>
#include <stddef.h>
typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
static malloc_fn cuda_malloc;
static free_fn cuda_free;
static void load(void) {
  if (cuda_malloc) return;
  void *h = dlopen(CUDART, RTLD_NOW | RTLD_NOLOAD);
  cuda_malloc = (malloc_fn)dlsym(h, "cudaMalloc");
  cuda_free = (free_fn)dlsym(h, "cudaFree");
}
void *tiny_alloc(size_t size, int device, void *stream) {
  void *p = NULL;
  load();
  return cuda_malloc(&p, size) == 0 ? p : NULL;
}
void tiny_free(void *p, size_t size, int device, void *stream) { load(); cuda_free(p); }
"""


@pytest.fixture
def tiny_allocator(tmp_path):
    """Another pluggable allocator over plain cudaMalloc, as vLLM's sleep mode brings its own."""
    torch = pytest.importorskip("torch")
    from alloc.plugin import loaded_cudart
    torch.cuda.init()
    cudart = loaded_cudart()
    src, so = tmp_path / "tiny.c", tmp_path / "tiny.so"
    src.write_text(TINY_ALLOCATOR)
    subprocess.run(["cc", "-shared", "-fPIC", f'-DCUDART="{cudart}"', str(src), "-o", str(so),
                    "-ldl"], check=True)
    return str(so)


@pytest.mark.parametrize("scope", ["workspace", "process"])
def test_another_mempool_over_another_allocator(tiny_allocator, scope):
    out = run(f"""
alloc.install(alloc.Config(budget_mb=32), scope={scope!r})
other = torch.cuda.memory.CUDAPluggableAllocator({tiny_allocator!r}, "tiny_alloc", "tiny_free")
try:
    pool = torch.cuda.MemPool(other.allocator())
except RuntimeError as e:
    print(json.dumps({{"refused": str(e)}}))
    raise SystemExit
with torch.cuda.use_mem_pool(pool):
    theirs = torch.full((1 << 20,), 2.0, device="cuda")
with alloc.workspace():
    ours = torch.full((1 << 20,), 3.0, device="cuda")
print(json.dumps({{"theirs": theirs.sum().item(), "ours": ours.sum().item(),
                  "ours_in_arena": alloc.device_arena(0, "workspace").owns(ours.data_ptr()),
                  "theirs_in_arena": alloc.device_arena(0, "workspace").owns(theirs.data_ptr())}}))
""")
    # Both scopes take a MemPool with an allocator of its own (vLLM's sleep mode): the process
    # scope's pool arenas reserve from that allocator (csrc/torch/backend_pool.c, docs/python-api.md).
    assert out == {"theirs": 2 << 20, "ours": 3 << 20, "ours_in_arena": True, "theirs_in_arena": False}


def test_compile_reduce_overhead_runs_beside_the_pool_with_outputs_equal_to_eager():
    out = run("""
alloc.install(alloc.Config(budget_mb=64), scope="workspace")
def f(x, w):
    return torch.relu(x @ w) * 2 + 1
g = torch.Generator(device="cuda").manual_seed(3)
x = torch.randn(256, 256, device="cuda", generator=g)
w = torch.randn(256, 256, device="cuda", generator=g)
with alloc.workspace():
    ws = torch.ones(1 << 20, device="cuda")
compiled = torch.compile(f, mode="reduce-overhead")  # CUDA-graph trees: PyTorch's own pools
errors = []
for _ in range(4):
    x.copy_(torch.randn(256, 256, device="cuda", generator=g))
    want = f(x, w)
    errors.append(((compiled(x, w) - want).norm() / want.norm()).item())
print(json.dumps({"errors": errors, "ws": ws.sum().item()}))
""")
    assert max(out["errors"]) < 1e-3 and out["ws"] == 1 << 20, out
