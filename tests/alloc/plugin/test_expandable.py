"""The general pools over the CUDA driver's page mapping (expandable, default auto) on a real GPU:
one address range per pool, 2 MiB pages mapped as blocks need them and unmapped by
torch.cuda.empty_cache(). Each test runs in a fresh interpreter (the allocator is chosen before
CUDA starts, and a wrong unmap would poison the CUDA context). The tests of test_gpu.py
and test_graphs.py run over the same mapped pools, since auto maps wherever the driver can."""

import pytest

from tests.support.gpu import DEVICE_COST_WORK, ORDINARY_WORK, run, simulated_meminfo

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def test_the_general_pools_map_pages_and_ordinary_work_matches_the_default_allocator():
    default = run(ORDINARY_WORK + "print(json.dumps(outs))")
    ours = run("alloc.install()\n" + ORDINARY_WORK + """
outs["expandable"] = alloc.device_is_expandable(0)
outs["key"] = alloc.memory_stats()["arena.expandable"]
outs["pages"] = [alloc.device_arena(0, p).page_size for p in ("small", "large")]
print(json.dumps(outs))
""")
    assert ours.pop("expandable") is True and ours.pop("key") == 1
    assert ours.pop("pages") == [2 * MiB, 2 * MiB]
    assert ours == default


def test_training_steps_match_the_default_allocator_with_empty_cache_between_them():
    body = """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator(device="cuda").manual_seed(7)
losses = []
for step in range(12):
    x = torch.randn(64 + 37 * step, 512, device="cuda", generator=g)  # a new shape every step
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item())
    if step % 3 == 2:
        torch.cuda.empty_cache()    # unmaps what is free; the parameters' pages stay
print(json.dumps({"losses": losses}))
"""
    assert run("alloc.install()\n" + body) == run(body)


def test_expandable_off_keeps_regions_and_on_maps_pages():
    code = """
alloc.install(alloc.Config(budget_mb=16, expandable={mode!r}))
ts = [torch.empty(5 << 20, dtype=torch.uint8, device="cuda") for _ in range(10)]
s = alloc.memory_stats()
print(json.dumps({{"expandable": alloc.device_is_expandable(0), "large": s["arena.large.capacity"],
                  "page": alloc.device_arena(0, "large").page_size, "regions": s["arena.large.regions"],
                  "maps": s["arena.large.backend_reserves"]}}))
"""
    off, on = run(code.format(mode="off")), run(code.format(mode="on"))
    assert off == {"expandable": False, "large": 60 * MiB, "page": 0, "regions": 3, "maps": 3}
    # Ten 5 MiB tensors in 25 pages of one stretch; the tail of each map serves the next request.
    assert on["expandable"] is True and on["large"] == 50 * MiB and on["page"] == 2 * MiB
    assert on["regions"] == 1 and on["maps"] <= 10


def test_mapped_pools_cost_the_device_what_they_map():
    """The device pays for the pages mapped and no more (test_gpu.py checks the same of
    regions): the large tensors fill the pages of one stretch, and the small ones share pages."""
    out = run("""
alloc.install()
""" + DEVICE_COST_WORK + """print(json.dumps({"device": free0 - torch.cuda.mem_get_info()[0], "held": alloc.memory_reserved() - held0,
                  "expandable": alloc.device_is_expandable(0), "stretches": s["arena.large.regions"]}))
""")
    need = (3 * 12 + 12 * 6 + 20) * MiB                 # live bytes, whole pages in both pools
    assert out["expandable"] and out["stretches"] == 1
    # The small pool's first page was mapped (for the freed 1-byte tensor) before held0 was read, and
    # the small tensors fill it: held is need less that page (need, were it not reused).
    assert need - 2 * MiB <= out["held"] <= need, out
    assert abs(out["device"] - out["held"]) <= 2 * MiB, out


def test_memory_stats_count_mapped_bytes():
    out = run("""
alloc.install(alloc.Config(budget_mb=16))
a = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")
with alloc.workspace():
    b = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
s = alloc.memory_stats()
print(json.dumps({"reserved": s["reserved_bytes.all.current"], "torch": torch.cuda.memory_reserved(),
                  "device_alloc": s["num_device_alloc"], "segments": s["segment.large_pool.current"]}))
""")
    assert out == {"reserved": (16 + 6) * MiB, "torch": (16 + 6) * MiB, "device_alloc": 2, "segments": 1}


def test_empty_cache_unmaps_and_cudaMemGetInfo_sees_it_while_live_tensors_keep_their_data():
    out = run("""
alloc.install()
keep = torch.arange(3 << 20, dtype=torch.float32, device="cuda")   # 12 MiB, stays live
ts = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (30, 50, 70)]
small = [torch.ones(1000, device="cuda") for _ in range(100)]
for t in ts:
    t.fill_(7)
torch.cuda.synchronize()
held = alloc.memory_reserved()
del ts, small, t                                        # t, the loop's last, is the 70 MiB tensor
free_before = torch.cuda.mem_get_info()[0]
torch.cuda.empty_cache()
free_after = torch.cuda.mem_get_info()[0]
after = alloc.memory_reserved()                         # before anything else is allocated
again = torch.empty(100 << 20, dtype=torch.uint8, device="cuda")   # maps anew after the unmap
again.fill_(3)
print(json.dumps({"held": held, "after": after, "freed": free_after - free_before,
                  "keep_ok": bool((keep == torch.arange(3 << 20, dtype=torch.float32, device="cuda")).all()),
                  "again": again.sum().item(), "releases": alloc.memory_stats()["num_device_free"]}))
""")
    assert out["held"] >= (12 + 150) * MiB + 2 * MiB
    assert out["after"] == 12 * MiB                 # only the pages the live tensor touches
    assert out["freed"] >= 150 * MiB                # the driver has the pages back at once
    assert out["keep_ok"] and out["again"] == 3 * (100 << 20) and out["releases"] >= 1


def test_empty_cache_waits_for_other_streams_before_unmapping_a_block():
    """x is read on a side stream behind a long sleep; it is freed, and empty_cache comes at once.
    Unmapping its pages before the side stream reads them would fault the context (illegal
    address); the release must wait for the stream work instead."""
    out = run("""
alloc.install()
side = torch.cuda.Stream()
results = []
for trial in range(3):
    x = torch.full((16 << 20,), 1.0, device="cuda")       # 64 MiB: whole pages of its own
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)                      # tens of milliseconds
        y = x * 2
    x.record_stream(side)
    y.record_stream(torch.cuda.current_stream())
    del x
    reserved = alloc.memory_reserved()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    unmapped = reserved - alloc.memory_reserved()       # before y.min() maps a small page
    results.append([y.min().item(), y.max().item(), unmapped])
    del y
print(json.dumps({"results": results}))
""")
    for lo, hi, unmapped in out["results"]:
        assert lo == hi == 2.0 and unmapped >= 64 * MiB


def test_nothing_is_unmapped_while_a_graph_captures():
    out = run("""
alloc.install()
x = torch.ones(16 << 20, device="cuda")                     # 64 MiB, freed during the capture
static = torch.ones(1 << 20, device="cuda")
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    del x
    before = alloc.memory_reserved()
    torch.cuda.empty_cache()                                # a capture runs: nothing goes back
    during = alloc.memory_reserved()
    out = static * 3
graph.replay()
torch.cuda.synchronize()
ok = out.sum().item()
mid = alloc.memory_reserved()                               # out's graph pool region is counted now
torch.cuda.empty_cache()                                    # now the pages go
after = alloc.memory_reserved()
graph.replay()
torch.cuda.synchronize()
print(json.dumps({"before": before, "during": during, "mid": mid, "after": after, "ok": ok,
                  "again": out.sum().item()}))
""")
    assert out["during"] == out["before"] and out["mid"] - out["after"] >= 64 * MiB
    assert out["ok"] == out["again"] == 3 * (1 << 20)


def test_driver_out_of_memory_raises_cleanly_and_leaves_no_page_mapped():
    out = run("""
alloc.install()
MiB = 1 << 20
keep = torch.ones(1 << 20, device="cuda")
torch.cuda.synchronize()
free0, total = torch.cuda.mem_get_info()
# More than the device can ever give this process (its own context takes more than 8 MiB), inside
# the range: free0 + (total - free0) // 2 fitted when other processes freed memory meanwhile.
ask = total - 8 * MiB
try:
    torch.empty(ask, dtype=torch.uint8, device="cuda")
    err, kind = None, None
except torch.OutOfMemoryError as e:
    err, kind = str(e), type(e).__name__
free1 = torch.cuda.mem_get_info()[0]
try:
    torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    wide = None
except torch.OutOfMemoryError as e:
    wide = str(e)
ok = torch.full((1 << 20,), 2.0, device="cuda").sum().item() + keep.sum().item()
s = alloc.memory_stats()
print(json.dumps({"err": err, "kind": kind, "wide": wide, "leak": free0 - free1, "ok": ok,
                  "ooms": s["num_ooms"], "failures": s["arena.large.backend_failures"]}))
""")
    assert out["kind"] == "OutOfMemoryError" and "general large pool" in out["err"]
    assert "cuMemCreate" in out["err"] and "out of memory" in out["err"], out["err"]
    assert out["leak"] < 8 * MiB                            # the pages of the failed call went back
    assert "address range" in out["wide"], out["wide"]
    assert out["ok"] == 3 * (1 << 20) and out["ooms"] == 2 and out["failures"] >= 1


def test_memory_fraction_caps_mapped_bytes():
    out = run("""
alloc.install(alloc.Config(budget_mb=64))
total = torch.cuda.mem_get_info()[1]
torch.cuda.set_per_process_memory_fraction((1 << 30) / total)
keep = [torch.empty(300 << 20, dtype=torch.uint8, device="cuda") for _ in range(3)]
cached = torch.empty(100 << 20, dtype=torch.uint8, device="cuda")
del cached                                                  # 100 MiB mapped and free
big = torch.empty(120 << 20, dtype=torch.uint8, device="cuda")   # the free 100 MiB and 20 more
try:
    torch.empty(200 << 20, dtype=torch.uint8, device="cuda")
    err = None
except torch.OutOfMemoryError as e:
    err = str(e)
print(json.dumps({"err": err, "reserved": alloc.memory_reserved()}))
""")
    assert "set_per_process_memory_fraction" in out["err"] and "1024 MiB" in out["err"]
    assert out["reserved"] == 900 * MiB + 120 * MiB


def test_unified_guard_checks_every_mapping(tmp_path):
    """Forced unified mode over mapped pools: host memory is read before every map, and a map that
    would cross the headroom is refused before the driver is asked."""
    out = run(simulated_meminfo(tmp_path / "meminfo", "4 << 30") + """
alloc.install(alloc.Config(budget_mb=16, unified="on", host_headroom_mb=0, meminfo=path))
torch.cuda.init()
free0 = torch.cuda.mem_get_info()[0]
update()
held = []
try:
    while True:
        held.append(torch.ones(256 << 20, dtype=torch.uint8, device="cuda"))
        update()
except torch.OutOfMemoryError as e:
    err = str(e)
sums = [t[::4096].sum().item() for t in held]
print(json.dumps({"err": err, "got": len(held), "sums": sums, "expandable": alloc.device_is_expandable(0)}))
""", env={"INDEXER_ARENA_CONF": ""})
    assert out["expandable"] and "unified memory: mapping" in out["err"], out["err"]
    assert "refused before asking the driver" in out["err"]
    assert 13 <= out["got"] <= 16 and all(s == (256 << 20) // 4096 for s in out["sums"])


def test_a_standalone_cuda_mapping_arena():
    out = run("""
from alloc.plugin import loaded_cudart
torch.cuda.init()
a = alloc.Arena(0, backend="cuda", device=0, cudart=loaded_cudart(), growable=True,
                address_range=4 << 30)
free0 = torch.cuda.mem_get_info()[0]
p = a.allocate(300 << 20)
q = a.allocate(1 << 20)
mid = torch.cuda.mem_get_info()[0]
a.free(p)
released = a.release_cached()
end = torch.cuda.mem_get_info()[0]
a.check()
s = a.stats()
r = a.address_range()
a.free(q)
a.close()
print(json.dumps({"page": a.page_size, "took": free0 - mid, "released": released, "back": end - mid,
                  "capacity": s["capacity"], "inside": r.base <= p < r.base + r.size, "size": r.size}))
""")
    assert out["page"] == 2 * MiB and out["size"] == 4 << 30 and out["inside"]
    assert out["took"] >= 302 * MiB and out["released"] == 300 * MiB
    assert out["back"] >= 300 * MiB and out["capacity"] == 2 * MiB


def test_another_device_reaches_mapped_pages_once_pytorch_enables_peer_access():
    out = run("""
if torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(0, 1):
    print(json.dumps({"skip": True}))
    raise SystemExit
alloc.install()
a = torch.arange(1 << 22, dtype=torch.float32, device="cuda:1")   # pages of device 1's pool
b = a.to("cuda:0")                          # PyTorch enables peer access, then copies device to device
c = torch.empty(1 << 22, device="cuda:0")
c.copy_(a)
d = torch.arange(1 << 22, dtype=torch.float32, device="cuda:1")   # mapped after the grant
e = d.to("cuda:0")
torch.cuda.synchronize(0)
torch.cuda.synchronize(1)
expect = torch.arange(1 << 22, dtype=torch.float32, device="cuda:0")
print(json.dumps({"ok": [bool((x == expect).all()) for x in (b, c, e)],
                  "expandable": [alloc.device_is_expandable(0), alloc.device_is_expandable(1)]}))
""")
    if out.get("skip"):
        pytest.skip("needs two GPUs that can reach each other's memory")
    assert out == {"ok": [True, True, True], "expandable": [True, True]}
