"""CUDA graphs and torch.compile under the process scope, on a real GPU.

Each case runs in a fresh interpreter under PyTorch's own allocator and under ``alloc.install()``,
so that a case that crashes or breaks a capture cannot hide the others. A case checks its graphs'
replays against eager execution on fresh random data itself, and prints what it computed; the two
allocators must print the same numbers, bit for bit."""


import pytest

from tests.support.gpu import run

pytestmark = pytest.mark.gpu

ARENA = "alloc.install(alloc.Config(budget_mb=256))\n"


def both(body: str, timeout: float = 300) -> dict:
    default = run("ARENA = False\n" + body, timeout=timeout)
    ours = run("ARENA = True\n" + ARENA + body, timeout=timeout)
    assert ours["numbers"] == default["numbers"], (ours, default)
    return ours


def test_a_simple_capture_replays_like_eager():
    both("""
g = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(4096, device="cuda", generator=g)
ones = torch.ones(4096, 8, device="cuda")
def f(x):
    return (x * 2 + 1).sin() @ ones
f(x)                                       # warm-up: cuBLAS makes its handle outside the capture
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    y = f(x)
numbers = []
for _ in range(3):
    x.copy_(torch.randn(4096, device="cuda", generator=g))
    graph.replay()
    assert torch.equal(y, f(x))
    numbers.append(y.double().sum().item())
print(json.dumps({"numbers": numbers}))
""")


SHARED_POOL = """
g = torch.Generator(device="cuda").manual_seed(2)
inputs = [torch.randn(n, 512, device="cuda", generator=g) for n in (64, 128, 256)]
weights = [torch.randn(512, 512, device="cuda", generator=g) for _ in range(3)]
def step(x):
    h = x
    for w in weights:                      # intermediates freed inside the capture
        h = torch.relu(h @ w) / 16
    return h.sum(1)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):              # warm-up on a side stream, as the docs ask
    for x in inputs:
        step(x)
torch.cuda.current_stream().wait_stream(side)
graphs, outs, pool = [], [], None
for x in inputs[:COUNT]:                   # one graph per batch size, one shared pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outs.append(step(x))
    pool = graph.pool()
    graphs.append(graph)
numbers = []
for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0, 0], [2, 2, 1]):
    for i in order:
        if i >= COUNT:
            continue
        inputs[i].copy_(torch.randn(inputs[i].shape, device="cuda", generator=g))
        before = [outs[e].clone() for e in range(i)]
        graphs[i].replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[i], step(inputs[i])), (order, i)
        numbers.append(outs[i].double().sum().item())
        # A later graph never takes what an earlier one's live output holds, so its replay leaves
        # the outputs of the graphs captured before it as they were. (An earlier graph may reuse
        # what a later one's output holds: shared pools are documented to replay in capture order.)
        for e in range(i):
            assert torch.equal(outs[e], before[e]), ("kept", order, i, e)
print(json.dumps({"numbers": numbers}))
"""


@pytest.mark.parametrize("count", [2, 3])
def test_graphs_sharing_one_pool_replay_exactly_in_any_order(count):
    both(f"COUNT = {count}\n" + SHARED_POOL)


# After `step`, `x`, `g`: step warmed up on a side stream, captured, replayed three times on fresh
# random x, each replay equal to eager execution; numbers gets each replay's sum.
REPLAYED = """
torch.cuda.synchronize()
s0 = torch.cuda.Stream()
s0.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s0):
    step(x)
torch.cuda.current_stream().wait_stream(s0)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    y = step(x)
numbers = []
for _ in range(3):
    x.copy_(torch.randn(x.shape, device="cuda", generator=g))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, step(x))
    numbers.append(y.double().sum().item())
"""


@pytest.mark.parametrize("streams", [2, 4])
def test_a_capture_over_several_streams_with_record_stream(streams):
    both(f"""
g = torch.Generator(device="cuda").manual_seed(3)
x = torch.randn(2048, 256, device="cuda", generator=g)
w = torch.randn(256, 256, device="cuda", generator=g)
side = [torch.cuda.Stream() for _ in range({streams} - 1)]
def step(x):
    main = torch.cuda.current_stream()
    shared = torch.tanh(x @ w)             # made on the main stream, read on the others
    parts = []
    for s in side:
        s.wait_stream(main)
        with torch.cuda.stream(s):
            shared.record_stream(s)
            parts.append((shared * (len(parts) + 2)).cumsum(0))
    for s in side:
        main.wait_stream(s)
    del shared                             # freed while the side streams still use it
    return torch.stack(parts).sum(0)
""" + REPLAYED + """
print(json.dumps({"numbers": numbers}))
""")


@pytest.mark.parametrize("streams", [2, 4])
def test_record_stream_reuse_reuses_a_block_inside_the_capture_once_its_streams_are_joined(streams):
    # PyTorch's graph_capture_record_stream_reuse: the block the side streams read is not reused
    # before they are joined back, is reused after, and the replays still match eager execution.
    both(f"""
torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:True")
g = torch.Generator(device="cuda").manual_seed(4)
x = torch.randn(1024, 256, device="cuda", generator=g)
w = torch.randn(256, 256, device="cuda", generator=g)
side = [torch.cuda.Stream() for _ in range({streams} - 1)]
def step(x):
    main = torch.cuda.current_stream()
    shared = torch.tanh(x @ w)             # read on the side streams, freed before they join
    freed = shared.data_ptr()
    parts = []
    for s in side:
        s.wait_stream(main)
        with torch.cuda.stream(s):
            shared.record_stream(s)
            parts.append((shared * (len(parts) + 2)).cumsum(0))
    del shared
    early = torch.empty_like(x)            # the side streams still read the freed block
    early.copy_(x * 3)
    for s in side:
        main.wait_stream(s)
    late = torch.empty_like(x)             # joined: the freed block may come back
    torch.matmul(x, w, out=late)
    late.sigmoid_()
    if torch.cuda.is_current_stream_capturing():
        reused[:] = [early.data_ptr() == freed, late.data_ptr() == freed]
    return torch.stack(parts).sum(0) + early + late
reused = []
""" + REPLAYED + """
assert reused == [False, True], reused
print(json.dumps({"numbers": [reused] + numbers}))
""")


def test_a_deleted_graph_gives_its_memory_back_and_not_before():
    both("""
import gc
g = torch.Generator(device="cuda").manual_seed(4)
x = torch.randn(64 << 20, device="cuda", generator=g)   # 256 MiB
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    big = x * 3                            # 256 MiB held by the graph
    y = big.sum()
    del big
graph.replay()
numbers = [y.item()]
eager = [torch.empty(64 << 20, device="cuda") for _ in range(2)]
reserved_before = torch.cuda.memory_reserved()
spans = []
if ARENA:
    [held] = alloc.graph_pools()
    spans = [(b["address"], b["address"] + b["size"]) for b in alloc.graph_pool_blocks(held["id"])]
    assert held["capacity"] >= 256 << 20
    for t in eager:
        assert not any(lo <= t.data_ptr() < hi for lo, hi in spans), "eager code got graph memory"
del eager
graph.replay()
numbers.append(y.item())
del graph, y
gc.collect()
torch.cuda.synchronize()
freed = reserved_before - torch.cuda.memory_reserved()
if ARENA:
    assert alloc.graph_pools() == []
    assert freed >= 256 << 20, freed
    again = torch.empty(64 << 20, device="cuda")
    again.fill_(1)
    assert again.sum().item() == 64 << 20
print(json.dumps({"numbers": numbers}))
""")


def test_an_output_rebound_in_the_next_capture_keeps_its_memory_after_reset_and_empty_cache():
    # PyTorch's test_graph_capture_reset_recapture, then eager churn between the second capture
    # and its replays: graph 2 writes the first graph's output, which was freed inside graph 2's
    # capture, at every replay. Under the arena empty_cache() runs too: PyTorch's allocator would
    # give that memory back there, and graph 2 would write memory it no longer has.
    both("""
g = torch.Generator(device="cuda").manual_seed(6)
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    a = torch.randn(1 << 22, device="cuda", generator=g)
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin()
    b = a
    for _ in range(10):
        b = b + 1
    graph.capture_end()
torch.cuda.current_stream().wait_stream(s)
graph.replay()
numbers = [b.double().sum().item()]
expect = a
for _ in range(10):
    expect = expect + 1
assert torch.equal(b, expect)
graph.reset()                              # b outlives its graph
old = b.data_ptr()
with torch.cuda.stream(s):
    graph.capture_begin()
    b.fill_(2.0)                           # graph 2 writes the old b ...
    for _ in range(10):
        b = b + 2                          # ... and frees it inside the capture
    graph.capture_end()
torch.cuda.current_stream().wait_stream(s)
if ARENA:
    torch.cuda.empty_cache()
churn = [torch.randn(1 << 22, device="cuda", generator=g) for _ in range(8)]
copies = [c.clone() for c in churn]
if ARENA:
    assert all(not (c.data_ptr() <= old < c.data_ptr() + (4 << 22)) for c in churn)
for _ in range(3):
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(b, torch.full_like(b, 22.0))
    numbers.append(b.double().sum().item())
assert all(torch.equal(c, d) for c, d in zip(churn, copies)), "a replay wrote eager memory"
graph.reset()
del graph
numbers.append(b.double().sum().item())
print(json.dumps({"numbers": numbers}))
""")


def test_make_graphed_callables_with_backward_matches_eager():
    both("""
torch.manual_seed(5)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).cuda()
reference = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).cuda()
reference.load_state_dict(model.state_dict())
g = torch.Generator(device="cuda").manual_seed(5)
sample = torch.randn(32, 64, device="cuda", requires_grad=True, generator=g)
graphed = torch.cuda.make_graphed_callables(model, (sample,))
numbers = []
for _ in range(3):
    model.zero_grad()                      # the warm-up's backward passes accumulated into them
    reference.zero_grad()
    x = torch.randn(32, 64, device="cuda", generator=g)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = graphed(xa), reference(xb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert torch.allclose(ya, yb, rtol=1e-5, atol=1e-5)
    assert torch.allclose(xa.grad, xb.grad, rtol=1e-4, atol=1e-5)
    for pa, pb in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(pa.grad, pb.grad, rtol=1e-4, atol=1e-5)
    numbers.append(ya.double().sum().item())
    numbers.append(xa.grad.double().sum().item())
print(json.dumps({"numbers": numbers}))
""")


def test_random_numbers_in_a_graph_advance_per_replay():
    both("""
torch.manual_seed(6)
x = torch.empty(1 << 20, device="cuda")
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    x.uniform_()
    y = torch.randn(1 << 16, device="cuda") + x[: 1 << 16]
numbers = []
for _ in range(3):
    graph.replay()
    torch.cuda.synchronize()
    numbers.append(x.double().sum().item())
    numbers.append(y.double().sum().item())
assert len(set(numbers[::2])) == 3 and 0.45 < x.mean().item() < 0.55   # fresh values each replay
print(json.dumps({"numbers": numbers}))
""")


def test_out_of_memory_during_capture_raises_and_a_later_capture_works():
    out = run(ARENA + """
x = torch.randn(1 << 20, device="cuda")
torch.cuda.synchronize()
too_big = torch.cuda.get_device_properties(0).total_memory * 2
messages = []
for attempt in ("general", "workspace"):
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            if attempt == "general":
                torch.empty(too_big, dtype=torch.uint8, device="cuda")
            else:
                with alloc.workspace():
                    torch.empty(512 << 20, dtype=torch.uint8, device="cuda")   # over the 256 MiB budget
    except torch.OutOfMemoryError as e:
        messages.append(str(e).splitlines()[0])
    del graph
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    y = x * 2
x.copy_(torch.randn_like(x))
graph.replay()
torch.cuda.synchronize()
assert torch.equal(y, x * 2)
print(json.dumps({"messages": messages, "captures": alloc.memory_stats()["arena.graphs.capacity"] > 0}))
""")
    assert len(out["messages"]) == 2, out
    assert "for CUDA graph pool" in out["messages"][0]
    assert "while capturing into CUDA graph pool" in out["messages"][1]


def test_a_workspace_inside_a_capture_is_served_by_the_arena_and_kept_by_the_graph():
    out = run(ARENA + """
g = torch.Generator(device="cuda").manual_seed(8)
q = torch.randn(512, 128, device="cuda", generator=g)
k = torch.randn(8192, 128, device="cuda", generator=g)
def scores(q, k):
    with alloc.workspace():
        logits = torch.empty(q.shape[0], k.shape[0], device="cuda")   # 16 MiB from the arena
    torch.matmul(q, k.T, out=logits)
    return logits.topk(16, dim=1).values
scores(q, k)                               # warm-up: cuBLAS makes its handle outside the capture
ws = alloc.device_arena(0, "workspace")
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    top = scores(q, k)
held = alloc.memory_stats()["arena.graphs.workspace"]
for _ in range(3):
    q.copy_(torch.randn(q.shape, device="cuda", generator=g))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(top, scores(q, k))      # eager workspaces still fit beside the graph's
eager_max = ws.stats()["largest_free"]
del graph, top
import gc; gc.collect()
print(json.dumps({"held": held, "after": alloc.memory_stats()["arena.graphs.workspace"],
                  "eager_max": eager_max, "budget": 256 << 20,
                  "free_after": ws.stats()["largest_free"]}))
""")
    assert out["held"] >= 16 << 20 and out["after"] == 0, out
    assert out["eager_max"] <= out["budget"] - out["held"], out
    assert out["free_after"] == out["budget"], out


def test_torch_compile_reduce_overhead_matches_eager():
    both("""
torch.manual_seed(9)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.SiLU(), torch.nn.Linear(512, 256)).cuda().eval()
compiled = torch.compile(model, mode="reduce-overhead")
g = torch.Generator(device="cuda").manual_seed(9)
numbers = []
with torch.no_grad():
    for batch in (8, 8, 8, 16, 16, 16, 8, 16):   # two shapes: two graphs in one tree
        x = torch.randn(batch, 256, device="cuda", generator=g)
        y = compiled(x)
        assert torch.allclose(y, model(x), rtol=1e-4, atol=1e-5)
        numbers.append(round(y.double().sum().item(), 3))
print(json.dumps({"numbers": numbers}))
""", timeout=600)


def test_torch_compile_reduce_overhead_restores_checkpoints_between_paths():
    # A second compiled function fed the first one's output in a new generation: CUDA graph trees
    # record it on a new path, restoring the pool to the first graph's checkpoint
    # (setCheckpointPoolState) before they do.
    out = both("""
import torch._C as C
from torch._dynamo.mutation_guard import GenerationTracker
restores = []
original = C._cuda_setCheckpointPoolState
def counting(*args):
    restores.append(1)
    return original(*args)
C._cuda_setCheckpointPoolState = counting
g = torch.Generator(device="cuda").manual_seed(10)
square = torch.compile(lambda x: x @ x, mode="reduce-overhead")
pair = torch.compile(lambda x: (x[0], x @ x), mode="reduce-overhead")
numbers = []
with torch.no_grad():
    for _ in range(3):
        square(torch.rand(64, 64, device="cuda", generator=g))
    for _ in range(3):
        x = torch.rand(64, 64, device="cuda", generator=g)
        out = square(x)
        GenerationTracker.generation -= 1
        row, out2 = pair(out)
        expected = (x @ x) @ (x @ x)
        assert torch.allclose(out2, expected, rtol=1e-3, atol=1e-3)
        assert torch.equal(row, out[0])
        numbers.append(round(out2.double().sum().item(), 2))
        del row, out, out2
print(json.dumps({"numbers": numbers, "restores": len(restores)}))
""", timeout=600)
    assert out["restores"] >= 1, out


def test_a_plain_mempool_serves_what_is_allocated_inside_it():
    out = run(ARENA + """
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    inside = torch.randn(1 << 20, device="cuda")
outside = torch.randn(1 << 20, device="cuda")
[held] = alloc.graph_pools()
spans = [(b["address"], b["address"] + b["size"]) for b in alloc.graph_pool_blocks(held["id"]) if not b["is_free"]]
placed = [any(lo <= t.data_ptr() < hi for lo, hi in spans) for t in (inside, outside)]
use_count = pool.use_count()
del inside, pool
import gc; gc.collect()
print(json.dumps({"placed": placed, "use_count": use_count, "left": alloc.graph_pools()}))
""")
    # (one with an allocator of its own: test_scoped.py::test_another_mempool_over_another_allocator)
    assert out["placed"] == [True, False] and out["use_count"] == 1 and out["left"] == [], out
