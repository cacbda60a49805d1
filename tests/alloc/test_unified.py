"""Unified memory on the CPU: detection from attributes, host-memory reading (meminfo, cgroups),
the guard in front of the host backend, and the seed workload against a shrinking MemAvailable."""

import pytest

from alloc import Arena, ArenaOutOfMemory, BackendError, HostGuard
from arena_tools.fit import fit, replay, seed_workload
from alloc.hostmem import read
from arena_tools.torch_model import CachingAllocatorModel, ModelOutOfMemory
from alloc.unified import is_unified

MiB, GiB = 1 << 20, 1 << 30


@pytest.mark.parametrize("attributes, expected", [
    ({"integrated": 1, "pageable_memory_access": 1, "concurrent_managed_access": 1,
      "uses_host_page_tables": 1}, True),                      # GB10 / DGX Spark
    ({"integrated": 1}, True),                                  # Jetson-class
    ({"integrated": 0, "pageable_memory_access": 1, "concurrent_managed_access": 1,
      "uses_host_page_tables": 1}, False),                     # Grace Hopper: HBM of its own
    ({"integrated": 0, "concurrent_managed_access": 1}, False),  # a discrete H200
])
def test_detection_from_attributes(attributes, expected):
    assert is_unified(attributes) is expected


def test_detection_refuses_unknown_attributes():
    with pytest.raises(ValueError, match="unknown attributes"):
        is_unified({"integrated": 1, "coherent": 1})


def meminfo(tmp_path, available_kib, name="meminfo"):
    path = tmp_path / name
    path.write_text(f"MemTotal:       131072000 kB\nMemFree:         1000 kB\n"
                    f"MemAvailable:   {available_kib} kB\nBuffers:  5 kB\n")
    return str(path)


def cgroup(tmp_path, files: dict[str, str]):
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return str(root)


def test_meminfo_without_cgroup(tmp_path):
    m = read(meminfo(tmp_path, 1000), cgroup_root="")
    assert m.mem_available == 1000 * 1024 and m.available == 1000 * 1024 and m.cgroup_limit is None


def test_cgroup_v2_limit_bounds_what_is_available(tmp_path):
    root = cgroup(tmp_path, {"memory.max": f"{8 * GiB}\n", "memory.current": f"{6 * GiB}\n"})
    m = read(meminfo(tmp_path, 100 * GiB // 1024), root)
    assert m.cgroup_limit == 8 * GiB and m.cgroup_usage == 6 * GiB and m.available == 2 * GiB


def test_cgroup_v2_max_means_no_limit(tmp_path):
    root = cgroup(tmp_path, {"memory.max": "max\n", "memory.current": "123\n"})
    m = read(meminfo(tmp_path, 4 * MiB // 1024), root)
    assert m.cgroup_limit is None and m.available == 4 * MiB


def test_cgroup_v1_limit_and_its_unlimited_value(tmp_path):
    root = cgroup(tmp_path, {"memory/memory.limit_in_bytes": f"{3 * GiB}\n",
                             "memory/memory.usage_in_bytes": f"{GiB}\n"})
    assert read(meminfo(tmp_path, 50 * GiB // 1024), root).available == 2 * GiB
    root = cgroup(tmp_path, {"memory/memory.limit_in_bytes": "9223372036854771712\n",
                             "memory/memory.usage_in_bytes": f"{GiB}\n"})
    m = read(meminfo(tmp_path, 50 * GiB // 1024), root)
    assert m.cgroup_limit is None and m.available == 50 * GiB


def test_cgroup_usage_over_the_limit_leaves_nothing(tmp_path):
    root = cgroup(tmp_path, {"memory.max": "100\n", "memory.current": "200\n"})
    assert read(meminfo(tmp_path, GiB // 1024), root).available == 0


def test_unreadable_meminfo_is_a_clear_error(tmp_path):
    with pytest.raises(BackendError, match="cannot read"):
        read(str(tmp_path / "missing"))
    (tmp_path / "bad").write_text("MemTotal: 5 kB\n")
    with pytest.raises(BackendError, match="no MemAvailable"):
        read(str(tmp_path / "bad"))


def test_guard_trips_exactly_where_available_memory_says():
    available = [10 * MiB]
    with Arena(0, growable=True, region_min=MiB, region_round=MiB,
               guard=HostGuard(headroom=2 * MiB, available=lambda: available[0])) as a:
        p = a.allocate(8 * MiB)  # 10 - 8 = 2 MiB left: exactly the headroom, allowed
        with pytest.raises(ArenaOutOfMemory) as e:
            a.allocate(MiB)  # the simulated machine has not shrunk: 10 - 1 = 9 left, allowed
            available[0] = 2 * MiB + MiB - 1  # one byte short for a 1 MiB region
            a.allocate(MiB)
        msg = str(e.value)
        assert "unified memory" in msg and "headroom" in msg and "refused before asking the driver" in msg
        assert a.stats()["backend_failures"] == 1 and a.stats()["regions"] == 2
        available[0] = 3 * MiB
        q = a.allocate(MiB)  # usable afterwards
        for x in (p, q):
            a.free(x)
        a.check()


def test_guard_reads_a_meminfo_file(tmp_path):
    path = meminfo(tmp_path, 3 * 1024)  # 3 MiB
    guard = HostGuard(headroom=MiB, meminfo=path, cgroup_root="")
    with Arena(2 * MiB, guard=guard) as a:  # 3 - 2 = 1 MiB left: fits
        assert a.allocate(MiB)
    with pytest.raises(ArenaOutOfMemory, match="could not reserve 2.00 MiB.*unified memory"):
        Arena(2 * MiB + 4096, guard=guard)
    with pytest.raises(ArenaOutOfMemory, match="unified memory"):
        Arena(MiB, guard=HostGuard(meminfo=str(tmp_path / "missing")))


def test_seed_workload_default_model_fails_where_predicted_and_the_arena_completes():
    """8 GiB of host memory that shrinks by what the allocator reserves: PyTorch's allocator,
    modelled, crosses at the chunk the fit check predicts (and on a unified device would hang
    there); the arena, guarded and committed up front, serves all 254,000 tokens."""
    available = 8 * GiB
    budget = 512 * MiB
    predicted = fit(262_144, 3_200, 4, 512, 254_000, available_bytes=available).default_crossing
    assert predicted is not None
    with pytest.raises(ModelOutOfMemory) as e:
        replay(CachingAllocatorModel(capacity=available, retry_on_oom=False),
               seed_workload(254_000, 3_200, 4, budget))
    assert e.value.chunk == predicted

    reserved = []
    guard = HostGuard(available=lambda: available - sum(reserved))
    workspace = Arena(budget, guard=guard, name="workspace")
    reserved.append(workspace.stats()["capacity"])
    general = Arena(0, growable=True, region_min=2 * MiB, region_round=2 * MiB, guard=guard, name="general")
    tokens = 0
    for plan in seed_workload(254_000, 3_200, 4, budget):
        live = {}
        for event in plan.events:
            if hasattr(event, "nbytes"):
                arena = workspace if event.workspace else general
                live[event.key] = (arena, arena.allocate(event.nbytes))
            else:
                arena, address = live.pop(event.key)
                arena.free(address)
        reserved[1:] = [general.stats()["capacity"]]
        tokens = plan.seen
    assert tokens == 254_000
    assert workspace.stats()["backend_reserves"] == 1 and workspace.stats()["in_use"] == 0
    assert sum(reserved) < GiB
    workspace.close()
    general.close()


def test_a_path_c_would_cut_at_a_nul_byte_is_refused(tmp_path):
    path = meminfo(tmp_path, 3 * 1024)
    for make in (lambda p: read(p, cgroup_root=""), lambda p: HostGuard(meminfo=p),
                 lambda p: HostGuard(meminfo=path, cgroup_root=p)):
        with pytest.raises(ValueError, match=r"NUL byte at position \d+ would end the path there"):
            make(path + "\0/elsewhere")  # C would open `path` itself


def test_a_path_of_bytes_no_encoding_decodes_is_opened_whole(tmp_path):
    import os
    raw = os.path.join(os.fsencode(tmp_path), b"mem\xffinfo")  # not UTF-8: os.fsdecode escapes the byte
    with open(raw, "w") as f:
        f.write("MemAvailable:   2048 kB\n")
    assert read(os.fsdecode(raw), cgroup_root="").available == 2 * MiB
    with Arena(MiB, guard=HostGuard(meminfo=os.fsdecode(raw), cgroup_root="")) as a:
        assert a.allocate(4096)


# -- MemAvailable as written, across the integer line and beyond ---------------------------------
import re  # noqa: E402

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

MAX_KIB = (1 << 54) - 1  # kB whose bytes fit in 64 bits
KIB = st.one_of(st.integers(-(1 << 70), 1 << 70),
                st.sampled_from([0, 1, MAX_KIB, MAX_KIB + 1, (1 << 54) + 4, -5, 2**64, 2**64 + 1]))


def bad_line(message: str, line: str) -> bool:
    return f"bad line '{line}'" in message and f"from 0 to {MAX_KIB} (2**54 - 1" in message


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kib=KIB)
def test_mem_available_is_read_exactly_or_refused_naming_the_line(tmp_path, kib):
    try:
        m = read(meminfo(tmp_path, kib), cgroup_root="")
    except BackendError as e:
        assert not 0 <= kib <= MAX_KIB and bad_line(str(e), f"MemAvailable:   {kib} kB"), str(e)
    else:
        assert 0 <= kib <= MAX_KIB and m.mem_available == m.available == kib << 10


LINE = re.compile(r"[ \t]*([0-9]+)[ \t]*kB[ \t\r]*")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rest=st.text(st.sampled_from(" \t\r-+0123456789xkBMG.,"), max_size=24) | st.text(max_size=8))
def test_only_a_number_of_kb_is_a_mem_available_line(tmp_path, rest):
    rest = rest.replace("\n", "")
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: 5 kB\nMemAvailable:{rest}\nBuffers: 1 kB\n")
    match = LINE.fullmatch(rest)
    try:
        m = read(str(path), cgroup_root="")
    except BackendError as e:
        assert not (match and int(match[1]) <= MAX_KIB), str(e)
        assert "bad line 'MemAvailable:" in str(e)
    else:
        assert match and m.mem_available == int(match[1]) << 10


@pytest.mark.parametrize("kib", [(1 << 54) + 4, -5])
def test_the_guard_refuses_on_a_mem_available_it_cannot_read_and_the_arena_stays_whole(tmp_path, kib):
    good = meminfo(tmp_path, 64 * 1024)  # 64 MiB
    guard = HostGuard(meminfo=good, cgroup_root="")
    with Arena(0, growable=True, region_min=MiB, region_round=MiB, guard=guard) as a:
        p = a.allocate(MiB)
        meminfo(tmp_path, kib)  # the same file, now unreadable as a count
        with pytest.raises(ArenaOutOfMemory) as e:
            a.allocate(MiB)  # needs a second region: the guard reads the file
        assert bad_line(str(e.value), f"MemAvailable:   {kib} kB"), str(e.value)
        assert "host memory left is unknown and reserving 1.00 MiB was refused" in str(e.value)
        a.check()
        assert a.stats()["regions"] == 1 and a.owns(p)
        meminfo(tmp_path, 64 * 1024)
        q = a.allocate(MiB)  # readable again: the arena grows as before
        a.free(p)
        a.free(q)
        a.check()
    with pytest.raises(ArenaOutOfMemory, match="bad line"):
        meminfo(tmp_path, kib)
        Arena(MiB, guard=guard)


# -- cgroup files as written, across the integer line and beyond ---------------------------------
CGROUP_FILES = {"v2": ("memory.max", "memory.current"),
                "v1": ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")}
BYTES = st.one_of(st.integers(-(1 << 70), 1 << 70),
                  st.sampled_from([0, 1, 2**62 - 1, 2**62, 2**63, 2**64 - 1, 2**64, -5, 10**30]))
WORD = st.one_of(BYTES.map(str), st.text(st.sampled_from(" \t+-0123456789xmaMG."), max_size=12))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.sampled_from(sorted(CGROUP_FILES)), limit=WORD, usage=WORD)
def test_a_cgroup_file_is_read_exactly_or_refused_naming_it(tmp_path, layout, limit, usage):
    import shutil
    shutil.rmtree(tmp_path / "cgroup", ignore_errors=True)
    limit_file, usage_file = CGROUP_FILES[layout]
    root = cgroup(tmp_path, {limit_file: limit + "\n", usage_file: usage + "\n"})

    NO_LIMIT = "no limit"

    def value(word):  # what the file means, or None where it must be refused
        if word == "max":
            return NO_LIMIT
        return int(word) if word.isascii() and word.isdigit() and int(word) < 2**64 - 1 else None

    lim = value(limit)
    lim = NO_LIMIT if isinstance(lim, int) and lim >= 2**62 else lim  # v1's "no limit"
    use = value(usage) if lim != NO_LIMIT else 0  # 0 is a limit, read with its usage (issue 47)
    if use == NO_LIMIT:
        use = None  # "max" is no number of bytes in use
    try:
        m = read(meminfo(tmp_path, 4 * 1024 * 1024), cgroup_root=root)  # 4 GiB available
    except BackendError as e:
        bad, word = (limit_file, limit) if lim is None else (usage_file, usage)
        assert lim is None or use is None, str(e)
        assert f"{bad}: bad value '{word[:40]}'" in str(e)
        assert ("'max' or a number of bytes" if bad == limit_file else "hold a number of bytes") in str(e)
    else:
        assert lim is not None and use is not None
        limited = lim != NO_LIMIT
        assert m.cgroup_limit == (lim if limited else None)
        assert m.cgroup_usage == (use if limited else None)
        assert m.available == (min(4 * GiB, max(lim - use, 0)) if limited else 4 * GiB)


def test_a_cgroup_limit_of_zero_bytes_is_a_limit_and_max_is_none(tmp_path):
    # Issue 47: memory.max "0" was read as "no limit" (0 was also the sentinel for "max"), so the
    # guard counted on all of MemAvailable.
    zero = read(meminfo(tmp_path, 4 * 1024 * 1024),
                cgroup_root=cgroup(tmp_path / "zero", {"memory.max": "0\n", "memory.current": "0\n"}))
    assert zero.cgroup_limit == 0 and zero.cgroup_usage == 0 and zero.available == 0
    guard = HostGuard(meminfo=meminfo(tmp_path, 64 * 1024),
                      cgroup_root=cgroup(tmp_path / "zero2", {"memory.max": "0\n", "memory.current": "0\n"}))
    with pytest.raises(ArenaOutOfMemory):
        Arena(MiB, guard=guard)
    unlimited = read(meminfo(tmp_path, 4 * 1024 * 1024),
                     cgroup_root=cgroup(tmp_path / "max", {"memory.max": "max\n", "memory.current": "7\n"}))
    assert unlimited.cgroup_limit is None and unlimited.available == 4 * GiB


def test_the_guard_refuses_on_a_cgroup_limit_it_cannot_read(tmp_path):
    root = cgroup(tmp_path, {"memory.max": "-5\n", "memory.current": "0\n"})
    guard = HostGuard(meminfo=meminfo(tmp_path, 64 * 1024), cgroup_root=root)
    with pytest.raises(ArenaOutOfMemory, match=r"memory.max: bad value '-5'"):
        Arena(MiB, guard=guard)
