"""The installed allocator on a real GPU. Each test runs in a fresh interpreter, since the allocator
can only be chosen before CUDA starts."""

import json

import pytest

from tests.support.gpu import DEVICE_COST_WORK, ORDINARY_WORK, run, simulated_meminfo

pytestmark = pytest.mark.gpu


def test_ordinary_work_matches_the_default_allocator():
    default = run(ORDINARY_WORK + "print(json.dumps(outs))")
    ours = run("alloc.install()\n" + ORDINARY_WORK + "print(json.dumps(outs))")
    assert ours == default


def test_install_after_cuda_init_is_refused_and_twice_is_harmless():
    out = run("""
torch.zeros(1, device="cuda")
try:
    alloc.install()
except alloc.InstallError as e:
    msg = str(e)
print(json.dumps({"msg": msg}))
""")
    assert "already initialised" in out["msg"] and "before" in out["msg"]
    out = run("""
c = alloc.install()
assert alloc.install() == c  # the same configuration: nothing happens
try:
    alloc.install(alloc.Config(budget_mb=c.budget_mb * 2))
    other = "accepted"
except alloc.InstallError as e:
    other = str(e)
x = torch.ones(10, device="cuda")
print(json.dumps({"other": other, "sum": x.sum().item()}))
""")
    assert "already installed" in out["other"] and out["sum"] == 10


def test_workspace_tensors_come_from_the_arena_and_others_do_not():
    out = run("""
alloc.install(alloc.Config(budget_mb=64))
plain = torch.empty(1000, device="cuda")
with alloc.workspace():
    ws = torch.empty(3000, 1000, device="cuda")
    with alloc.workspace():
        nested = torch.empty(10, device="cuda")
after = torch.empty(1000, device="cuda")
region = alloc.device_arena(0, "workspace").regions()[0]
inside = lambda t: region.base <= t.data_ptr() < region.base + region.size
ws.fill_(2.0)
stats = alloc.memory_stats()
print(json.dumps({"ws": inside(ws), "nested": inside(nested), "plain": inside(plain), "after": inside(after),
                  "size": region.size, "sum": ws.sum().item(), "ws_in_use": stats["arena.workspace.in_use"],
                  "reserves": stats["arena.workspace.backend_reserves"]}))
""")
    assert out["ws"] and out["nested"] and not out["plain"] and not out["after"]
    assert out["size"] == 64 << 20 and out["sum"] == 6e6 and out["reserves"] == 1
    assert out["ws_in_use"] >= 3000 * 1000 * 4


@pytest.mark.device_wide
def test_growing_workspace_requests_never_call_cudaMalloc_again():
    out = run("""
alloc.install(alloc.Config(budget_mb=128))
alloc.reserve(0)
free0 = torch.cuda.mem_get_info()[0]
for i in range(1, 60):
    with alloc.workspace():
        t = torch.empty(i * 500_000, device="cuda")
    t.uniform_()
    del t
torch.cuda.synchronize()
s = alloc.memory_stats()
print(json.dumps({"reserves": s["arena.workspace.backend_reserves"], "grew": free0 - torch.cuda.mem_get_info()[0]}))
""")
    assert out["reserves"] == 1
    assert out["grew"] < 8 << 20  # only the general path's small regions, if any


def test_over_budget_raises_out_of_memory_and_the_process_goes_on():
    out = run("""
alloc.install(alloc.Config(budget_mb=32))
keep = torch.ones(1000, device="cuda")
t0 = time.perf_counter()
try:
    with alloc.workspace():
        torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
    err = None
except torch.OutOfMemoryError as e:
    err, kind = str(e), type(e).__name__
elapsed = time.perf_counter() - t0
with alloc.workspace():
    ok = torch.full((1 << 20,), 3.0, device="cuda")
print(json.dumps({"err": err, "kind": kind, "elapsed": elapsed, "sum": (ok.sum() + keep.sum()).item(),
                  "ooms": alloc.memory_stats()["num_ooms"]}))
""")
    msg = out["err"]
    assert out["kind"] == "OutOfMemoryError"
    assert msg.startswith("CUDA out of memory. Tried to allocate 40.00 MiB. GPU 0 has a total capacity of "), msg
    for part in ("device 0", "40.00 MiB", "budget 32.00 MiB", "largest free block", "budget_mb"):
        assert part in msg, (part, msg)
    assert out["elapsed"] < 1.0 and out["sum"] == 3 * (1 << 20) + 1000 and out["ooms"] == 1


def test_general_out_of_memory_raises_and_the_process_goes_on():
    out = run("""
alloc.install(alloc.Config(budget_mb=32))
try:
    torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    err = None
except torch.OutOfMemoryError as e:
    err = str(e)
x = torch.randn(1000, 1000, device="cuda")
print(json.dumps({"err": err, "ok": bool(torch.isfinite(x @ x).all())}))
""")
    assert "general large pool" in out["err"] and "empty_cache" in out["err"] and out["ok"]


@pytest.mark.device_wide
def test_empty_cache_returns_the_general_regions():
    out = run("""
alloc.install(alloc.Config(budget_mb=32))
alloc.reserve(0)
ts = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (30, 50, 70)]
small = [torch.empty(1000, device="cuda") for _ in range(100)]
held = alloc.memory_reserved()
del ts, small
cached = alloc.memory_reserved()
free_before = torch.cuda.mem_get_info()[0]
torch.cuda.empty_cache()
print(json.dumps({"held": held, "cached": cached, "after": alloc.memory_reserved(),
                  "freed": torch.cuda.mem_get_info()[0] - free_before}))
""")
    assert out["cached"] == out["held"] >= (150 << 20) + (32 << 20)
    assert out["after"] == 32 << 20  # the workspace arena stays
    assert out["freed"] >= 150 << 20


def test_raw_allocations_are_served_and_given_back():
    """PyTorch's raw entry points: Thrust's temporaries (torch.mode along a row longer than its
    fused kernel takes) come through raw_alloc, torch.cuda.caching_allocator_alloc through
    raw_alloc_with_stream, and both go back through raw_delete."""
    out = run("""
alloc.install()
g = torch.Generator(device="cuda").manual_seed(7)
x = torch.randint(0, 50, (3, 40000), generator=g, device="cuda")
x[:, ::7] = torch.tensor([[3], [17], [41]], device="cuda")  # each row's mode, by far
torch.cuda.synchronize()
base = torch.cuda.memory_allocated()
values, where = torch.mode(x, dim=1)
same = values.tolist() == [3, 17, 41]
picked = bool((x.gather(1, where[:, None])[:, 0] == values).all())
del values, where
torch.cuda.synchronize()
after_mode = torch.cuda.memory_allocated() - base
side = torch.cuda.Stream()
ptr = torch.cuda.caching_allocator_alloc(3 << 20, stream=side)
held = torch.cuda.memory_allocated() - base
torch.cuda.caching_allocator_delete(ptr)
print(json.dumps({"same": same, "picked": picked, "after_mode": after_mode, "held": held,
                  "after": torch.cuda.memory_allocated() - base}))
""")
    assert out["same"] and out["picked"]
    assert out["after_mode"] == 0 and out["held"] >= 3 << 20 and out["after"] == 0


@pytest.mark.device_wide
def test_general_regions_cost_the_device_what_they_hold():
    """Each region is one cudaMalloc of exactly its size: asking the driver for more (an
    alignment's padding) would cost a whole 2 MiB page a region, outside every pool's count.
    Regions, so expandable:off (mapped pools have one stretch each: test_expandable.py). The
    device's free memory is the whole device's: another test process's allocation once moved it
    by 4 MiB inside the window, hence the bound of half a page a region, which padding (a whole
    page a region) still exceeds; gpu_suite.sh now runs this test alone (device_wide)."""
    out = run("""
alloc.install(alloc.Config(expandable="off"))
""" + DEVICE_COST_WORK + """print(json.dumps({"device": free0 - torch.cuda.mem_get_info()[0], "held": alloc.memory_reserved() - held0,
                  "regions": s["arena.small.regions"] + s["arena.large.regions"]}))
""")
    assert out["regions"] >= 14
    assert out["held"] >= (3 * 12 + 12 * 6 + 20) << 20
    assert abs(out["device"] - out["held"]) < out["regions"] << 20, out


def test_record_stream_keeps_a_block_until_the_other_stream_is_done():
    out = run("""
alloc.install()
side = torch.cuda.Stream()
results = []
for trial in range(5):
    x = torch.full((1 << 22,), 1.0, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keeps the side stream busy for tens of ms
        y = x * 2
    x.record_stream(side)
    y.record_stream(torch.cuda.current_stream())
    del x
    z = torch.empty((1 << 22,), device="cuda")  # may reuse x's block: only after the side stream read it
    z.fill_(-5.0)
    torch.cuda.synchronize()
    results.append(y.min().item() == 2.0 and y.max().item() == 2.0)
print(json.dumps({"ok": results}))
""")
    assert all(out["ok"]), out


def test_threads_allocate_concurrently_with_intact_data():
    out = run("""
alloc.install(alloc.Config(budget_mb=256))
errors = []
def work(seed):
    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for i in range(200):
        n = int(torch.randint(1, 1 << 20, (1,), generator=g, device="cuda").item())
        scope = alloc.workspace() if i % 3 == 0 else contextlib.nullcontext()
        with scope:
            t = torch.full((n,), float(seed), device="cuda")
        u = torch.full((n // 2 + 1,), float(-seed), device="cuda")
        if t.min().item() != seed or t.max().item() != seed or u.max().item() != -seed:
            errors.append((seed, i))
threads = [threading.Thread(target=work, args=(s,)) for s in range(1, 9)]
[t.start() for t in threads]; [t.join() for t in threads]
stats = alloc.memory_stats()
print(json.dumps({"errors": errors, "live": stats["allocation.all.current"], "ws": stats["arena.workspace.in_use"]}))
""")
    assert out["errors"] == [] and out["ws"] == 0


def test_every_device_gets_its_own_arena():
    out = run("""
alloc.install(alloc.Config(budget_mb=32))
ranges = []
for d in range(torch.cuda.device_count()):
    with torch.cuda.device(d), alloc.workspace():
        t = torch.ones(100, device=f"cuda:{d}")
    r = alloc.device_arena(d, "workspace").regions()[0]
    assert r.base <= t.data_ptr() < r.base + r.size
    ranges.append([r.base, r.size, alloc.memory_stats(d)["arena.workspace.backend_reserves"]])
print(json.dumps({"ranges": ranges, "n": torch.cuda.device_count()}))
""")
    assert len(out["ranges"]) == out["n"] >= 1
    assert len({base for base, _, _ in out["ranges"]}) == out["n"]
    assert all(size == 32 << 20 and reserves == 1 for _, size, reserves in out["ranges"])


def test_memory_stats_use_pytorch_key_names():
    # Regions, whose sizes these figures spell out (test_expandable.py has the mapped ones).
    out = run("""
alloc.install(alloc.Config(budget_mb=16, expandable="off"))
a = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")
with alloc.workspace():
    b = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
s1 = alloc.memory_stats()
del a
alloc.reset_peak_memory_stats()
s2 = alloc.memory_stats()
t2 = torch.cuda.memory_stats()              # PyTorch's own call reads the same counters
print(json.dumps({"s1": s1, "s2": s2, "torch": [t2["allocated_bytes.all.current"], t2["allocated_bytes.all.peak"],
                  t2["reserved_bytes.all.current"], torch.cuda.memory_allocated(), torch.cuda.max_memory_reserved()]}))
""")
    s1, s2 = out["s1"], out["s2"]
    assert out["torch"] == [s2["allocated_bytes.all.current"], s2["allocated_bytes.all.peak"],
                            s2["reserved_bytes.all.current"], s2["allocated_bytes.all.current"],
                            s2["reserved_bytes.all.peak"]]
    assert s1["allocated_bytes.all.current"] == (5 << 20) + (1 << 20)
    assert s1["allocated_bytes.large_pool.current"] == 5 << 20
    assert s1["reserved_bytes.all.current"] == (16 << 20) + (20 << 20)  # workspace + one 20 MiB region
    assert s1["num_ooms"] == 0 and s1["num_alloc_retries"] == 0 and s1["num_device_alloc"] == 2
    assert s2["allocated_bytes.all.current"] == 1 << 20 and s2["allocated_bytes.all.peak"] == 1 << 20
    assert s1["arena.workspace.in_use"] == 1 << 20


@pytest.mark.device_wide
def test_forced_unified_mode_guards_every_reservation(tmp_path):
    """A simulated unified machine with 13.5 GiB of host memory available: the meminfo file is
    rewritten after every step with 13.5 GiB minus what this process took from the device, as
    MemAvailable falls on a real one. The seed workload completes in the arena; asking for more
    than is left fails at once instead of reaching the driver."""
    out = run(simulated_meminfo(tmp_path / "meminfo", "int(13.5 * (1 << 30))") + """
alloc.install(alloc.Config(budget_mb=512, unified="on", host_headroom_mb=0, meminfo=path))
torch.cuda.init()  # the arenas are reserved at the first allocation, after this baseline
free0 = torch.cuda.mem_get_info()[0]
update()
from arena_tools.fit import seed_workload
for plan in seed_workload(254_000, 3_200, 4, 512 << 20, topk=0):
    for rows in plan.pieces:
        with alloc.workspace():
            logits = torch.empty(rows, plan.width, device="cuda")
        logits.uniform_()
        torch.topk(logits, min(2048, plan.width), dim=1)
        del logits
    torch.cuda.synchronize()
    update()
tokens = plan.seen
held = []
try:
    while True:
        held.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
        update()
except torch.OutOfMemoryError as e:
    err = str(e)
t0 = time.perf_counter()
try:
    torch.empty(20 << 30, dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError:
    one_call = time.perf_counter() - t0
got = len(held)
del held
ok = torch.ones(10, device="cuda").sum().item()
print(json.dumps({"err": err, "got": got, "one_call": one_call, "unified": alloc.device_is_unified(0),
                  "ok": ok, "tokens": tokens}))
""", env={"INDEXER_ARENA_CONF": ""})
    assert out["unified"] and out["ok"] == 10 and out["tokens"] == 254_000
    assert "unified memory" in out["err"] and "refused before asking the driver" in out["err"]
    assert 11 <= out["got"] <= 13  # 13.5 GiB less the 512 MiB arena and the general regions
    assert out["one_call"] < 1.0


def test_oom_report_file_is_written_and_named(tmp_path):
    report = tmp_path / "oom.json"
    out = run(f"""
alloc.install(alloc.Config(budget_mb=16, oom_report={str(report)!r}))
try:
    with alloc.workspace():
        torch.empty(20 << 20, dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError as e:
    err = str(e)
print(json.dumps({{"err": err}}))
""")
    assert str(report) in out["err"]
    data = json.loads(report.read_text())
    assert data["format"] == "indexer-arena-report-2" and data["budget"] == 16 << 20
    pools = {p["pool"]: p for p in data["devices"][0]["pools"]}
    assert pools["workspace"]["stats"]["capacity"] == 16 << 20
    assert pools["workspace"]["stats"]["requests_failed"] == 1


def test_memory_fraction_caps_the_pools():
    out = run("""
alloc.install(alloc.Config(budget_mb=64))
total = torch.cuda.mem_get_info()[1]
torch.cuda.set_per_process_memory_fraction((1 << 30) / total)  # 1 GiB for everything
keep = [torch.empty(300 << 20, dtype=torch.uint8, device="cuda") for _ in range(3)]
try:
    torch.empty(300 << 20, dtype=torch.uint8, device="cuda")
    err = None
except torch.OutOfMemoryError as e:
    err = str(e)
print(json.dumps({"err": err, "reserved": alloc.memory_reserved()}))
""")
    assert "set_per_process_memory_fraction" in out["err"] and "1024 MiB" in out["err"]
    assert out["reserved"] == 3 * (300 << 20)  # no workspace was asked for, so none is reserved


def test_a_process_that_never_asks_for_a_workspace_reserves_no_budget():
    out = run("""
alloc.install(alloc.Config(budget_mb=512))
x = torch.ones(1000, device="cuda")
before = (alloc.device_arena(0, "workspace") is None, alloc.memory_reserved())
with alloc.workspace():
    y = torch.ones(1000, device="cuda")
print(json.dumps({"before": before, "after": alloc.memory_reserved()}))
""")
    assert out["before"] == [True, 2 << 20]  # one small region, no workspace arena yet
    assert out["after"] == (2 << 20) + (512 << 20)
