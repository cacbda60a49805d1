"""What the engine plugin relies on, on a real GPU, in both scopes: a workspace inside a CUDA graph
capture (a decode step replayed on fresh data equals the eager one), indexer logits the arena
cannot hold served outside it (alloc/engines.py), and release/reserve around an engine's
sleep. Each test runs in a fresh interpreter: benchmarks/gpu_suite.sh tests-scoped."""

import pytest

from tests.support.gpu import run

pytestmark = pytest.mark.gpu
MiB = 1 << 20
SCOPES = ["process", "workspace"]

DECODE_STEP = """
B, N, H, D, K = 8, 4096, 4, 64, 256

def decode_step(q, k, w):
    # the indexer's decode: float32 logits [B, N] taken from the workspace, then the top K per row
    with alloc.workspace():
        logits = torch.empty(B, N, device="cuda")
    torch.sum(torch.relu(torch.einsum("bhd,nd->bhn", q, k)) * w[..., None], dim=1, out=logits)
    return torch.topk(logits, K, dim=1).indices
"""


@pytest.mark.parametrize("scope", SCOPES)
def test_a_decode_step_with_workspace_logits_captured_as_a_graph_replays_as_eager(scope):
    out = run(f"""
alloc.install(alloc.Config(budget_mb=64), scope={scope!r})
torch.cuda.init()
alloc.reserve(0)
""" + DECODE_STEP + """
g = torch.Generator(device="cuda").manual_seed(11)
fresh = lambda *shape: torch.randn(*shape, device="cuda", generator=g)
sq, sk, sw = fresh(B, H, D), fresh(N, D), fresh(B, H).abs()
decode_step(sq, sk, sw)  # warm-up on the stream the pool was made on
torch.cuda.synchronize()
before = torch.cuda.memory_reserved() if alloc.installed_scope() == "workspace" else 0
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    captured = decode_step(sq, sk, sw)
torch.cuda.synchronize()
equal = []
for _ in range(5):
    sq.copy_(fresh(B, H, D)); sk.copy_(fresh(N, D)); sw.copy_(fresh(B, H).abs())
    graph.replay()
    eager = decode_step(sq, sk, sw)
    equal.append(bool(torch.equal(captured, eager)))
s = alloc.memory_stats()
print(json.dumps({"equal": equal, "reserves": s["arena.workspace.backend_reserves"],
                  "carved": s.get("arena.graphs.workspace", 0),
                  "graph_pool_growth": (torch.cuda.memory_reserved() - before) if before else 0}))
""")
    assert out["equal"] == [True] * 5, out
    assert out["reserves"] == 1, "the workspace stays one reservation"
    if scope == "process":  # carved from the workspace arena for the graph's lifetime
        assert out["carved"] >= 8 * 4096 * 4, out
    else:  # from the graph's private pool, as every other tensor of the capture
        assert out["graph_pool_growth"] >= 8 * 4096 * 4, out


@pytest.mark.parametrize("scope", SCOPES)
def test_logits_the_arena_cannot_hold_are_served_outside_it_and_counted(scope):
    out = run(f"""
alloc.install(alloc.Config(budget_mb=64), scope={scope!r})
from alloc import engines
torch.cuda.init()
alloc.reserve(0)

def paged_logits(q, kv, weights, lens, tables, schedule, width):  # DeepGEMM's shape of result
    return torch.full((weights.shape[0], width), 2.0, device="cuda")

routed = engines.logits_in_workspace(engines.paged_logits_bytes)(paged_logits)
regions = [(r.base, r.base + r.size) for r in alloc.device_arena(0, "workspace").regions()]
inside = lambda t: any(lo <= t.data_ptr() < hi for lo, hi in regions)
rows = lambda n: torch.zeros(n, 4, device="cuda")
small = routed(None, None, rows(16), None, None, None, 4096)    # 256 KiB: in the arena
big = routed(None, None, rows(512), None, None, None, 65536)    # 128 MiB: over the budget
with alloc.workspace():
    held = torch.empty(48 << 20, dtype=torch.uint8, device="cuda")
mid = routed(None, None, rows(128), None, None, None, 65536)    # 32 MiB: under it, but 16 MiB free
s = alloc.memory_stats()
print(json.dumps({{"inside": [inside(small), inside(big), inside(mid)],
                   "sums": [t.double().sum().item() for t in (small, big, mid)],
                   "outside": [s["arena.outside.calls"], s["arena.outside.bytes"] >> 20]}}))
""")
    assert out["inside"] == [True, False, False], out
    assert out["sums"] == [2.0 * 16 * 4096, 2.0 * 512 * 65536, 2.0 * 128 * 65536]
    assert out["outside"] == [2, 160], out


@pytest.mark.device_wide
@pytest.mark.parametrize("scope", SCOPES)
def test_release_and_reserve_move_the_devices_free_memory_by_the_budget(scope):
    out = run(f"""
alloc.install(alloc.Config(budget_mb=256), scope={scope!r})
torch.cuda.init()
torch.ones(1, device="cuda") + torch.full((1,), 3.0, device="cuda")  # kernels loaded before measuring
def free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]
alloc.reserve(0)
reserved = free()
with alloc.workspace():
    t = torch.ones(1 << 20, device="cuda")
try:
    alloc.release(0)
    busy = None
except alloc.WorkspaceBusy as e:
    busy = str(e)
del t
alloc.release(0)
released = free()
alloc.reserve(0)
again = free()
with alloc.workspace():
    x = torch.full((1 << 20,), 3.0, device="cuda")
print(json.dumps({{"busy": busy, "freed": released - reserved, "taken": released - again,
                   "value": x.sum().item(), "reserved_now": alloc.workspace_reserved(0)}}))
""")
    footprint = 256 * MiB if scope == "process" else 258 * MiB  # + the pool's small-block segment
    assert out["busy"] and out["busy"].startswith("cannot release the workspace of cuda:0: "), out
    assert footprint <= out["freed"] <= footprint + 2 * MiB, out
    assert footprint <= out["taken"] <= footprint + 2 * MiB, out
    assert out["value"] == 3.0 * (1 << 20) and out["reserved_now"]


@pytest.mark.parametrize("scope", SCOPES)
def test_statistics_read_from_another_thread_while_release_and_reserve_cycle(scope):
    # Issue 47 on a real device: a serving engine's metrics thread reads the memory statistics,
    # resets the peaks and takes snapshots while its sleep mode releases and reserves the
    # workspace arena. Nothing crashes, no cumulative counter goes down, every workspace computes.
    out = run(f"""
import threading
alloc.install(alloc.Config(budget_mb=64), scope={scope!r})
torch.cuda.init()
alloc.reserve(0)
stop, seen, problems = threading.Event(), [0], []
CUMULATIVE = ["allocated_bytes.all.allocated", "allocated_bytes.all.freed", "num_device_alloc", "num_device_free",
              "segment.all.allocated", "segment.all.freed"]

def reader():
    last = {{}}
    while not stop.is_set():
        s = torch.cuda.memory_stats()
        for key in CUMULATIVE:
            if s.get(key, 0) < last.get(key, 0):
                problems.append(f"{{key}} went from {{last[key]}} to {{s[key]}}")
            last[key] = s.get(key, 0)
        alloc.memory_stats()
        torch.cuda.memory_allocated(); torch.cuda.max_memory_reserved()
        if seen[0] % 5 == 0:
            torch.cuda.reset_peak_memory_stats()
        if seen[0] % 7 == 0 and alloc.installed_scope() == "process":
            torch.cuda.memory_snapshot()
        seen[0] += 1

threads = [threading.Thread(target=reader) for _ in range(2)]
for t in threads:
    t.start()
sums = []
for i in range(150):
    with alloc.workspace():
        x = torch.full((1 << 20,), float(i % 7), device="cuda")
    sums.append(x.sum().item() == float(i % 7) * (1 << 20))
    del x
    alloc.release(0)
    if i % 2:
        alloc.reserve(0)
stop.set()
for t in threads:
    t.join()
print(json.dumps({{"sums": all(sums), "problems": problems[:5], "reads": seen[0]}}))
""")
    assert out["sums"] and not out["problems"] and out["reads"] > 50, out
