"""The C core on aarch64 (the CPU of DGX Spark and of Grace): built with the cross compiler, its
harnesses (tests/support/stress/) run under qemu-user, and the cffi extension built against an
aarch64 Python, which imports it and runs a share of the Python tests with it.

qemu runs Arm code with this machine's stronger memory ordering, so a missing barrier cannot
show here: the review of the core's memory orders is written beside the code (csrc/). What
these runs show is that the core builds for Arm and that its locks, atomics, thread-local storage
and the harnesses' checks hold there. Fewer operations than the
native runs of test_harnesses.py where qemu is slow (the sanitized and graph harnesses).

Without the cross toolchain these tests skip, saying so; CI sets INDEXER_ARENA_REQUIRE_AARCH64=1,
which makes that a failure (tests/support/aarch64.py, .ci/aarch64)."""

import pytest

from tests.support import aarch64 as arm

SANITIZERS = ("-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined")


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    """core(*flags): the core's aarch64 objects built with ``flags``, once a module."""
    arm.need(arm.toolchain_missing())
    built = {}

    def objects(*flags):
        if flags not in built:
            built[flags] = arm.compile_core(tmp_path_factory.mktemp("aarch64-core"), flags)
        return built[flags]
    return objects


def harness(core, tmp_path, name, flags=()):
    return arm.build_harness(tmp_path, name, core(*flags), flags)


def ok(done, *, first="ok"):
    assert done.returncode == 0 and done.stdout.startswith(first), done.stdout + done.stderr[-3000:]
    return done.stdout.split()


# stress.c: threads handing blocks to each other, canaries in every block; args are
# THREADS OPS CAPACITY_MIB [mapped].
STRESS = {
    "plain": ((), (4, 300_000, 64)),
    "tight": ((), (4, 100_000, 1)),
    "mapped": ((), (4, 100_000, 64, "mapped")),
    "invariant-walk": (("-DIA_DEBUG=1",), (4, 3_000, 1)),
}


@pytest.mark.parametrize("mode", list(STRESS))
def test_threads_stress_the_core_on_aarch64(core, tmp_path, mode):
    flags, args = STRESS[mode]
    fields = ok(arm.run(harness(core, tmp_path, "stress", flags), *args))
    threads, ops = args[:2]
    assert int(fields[1]) == threads * ops
    assert int(fields[7]) > ops  # allocations served


@pytest.mark.parametrize("target,rounds,blocks", [("arena", 100, 128), ("plugin", 30, 64)])
def test_threads_free_the_same_blocks_at_once_on_aarch64(core, tmp_path, target, rounds, blocks):
    """double_free.c: one free of each block succeeds, the others are refused, the invariant walk
    holds after every round."""
    fields = ok(arm.run(harness(core, tmp_path, "double_free"), target, 4, rounds, blocks))
    assert int(fields[1]) == rounds * blocks and int(fields[2]) == 3 * rounds * blocks


def test_graphs_are_captured_while_threads_allocate_on_aarch64(core, tmp_path):
    done = ok(arm.run(harness(core, tmp_path, "graphs_stress"), 4, 3_000, 60))
    assert done == ["ok"]


@pytest.mark.parametrize("name,seeds,steps", [("fuzz", (1, 2, 3, 4), 20_000),
                                              ("registry_check", (1,), 300),
                                              ("class_check", (1,), 200_000)])
def test_sanitized_harnesses_on_aarch64(core, tmp_path, name, seeds, steps):
    """fuzz.c's random operation sequences, the region registry and the size classes under
    AddressSanitizer and UBSan (which catch Arm's stricter alignment among the rest)."""
    exe = harness(core, tmp_path, name, SANITIZERS)
    for seed in seeds:
        done = arm.run(exe, seed, steps)
        assert done.returncode == 0 and done.stdout.strip() == "ok", f"seed {seed}: {done.stderr[-3000:]}"


# The Python tests the aarch64 Python runs with the aarch64 extension: the arena's face, its
# streams and statistics, the plugin's graph pools and mapped pools on the host backend, Python
# threads. Not those that need torch (the out-of-memory shim) or Hypothesis (its wheel here
# carries a compiled module of this machine's).
PYTHON_TESTS = ("tests/alloc/arena/test_basic.py", "tests/alloc/arena/test_streams.py",
                "tests/alloc/arena/test_stats.py", "tests/alloc/plugin/test_graph_pools.py",
                "tests/alloc/plugin/test_mapped_pools.py", "tests/alloc/plugin/test_graph_reuse.py",
                "tests/csrc/test_harnesses.py::test_python_threads_hand_blocks_to_each_other",
                "--deselect", "tests/alloc/plugin/test_graph_pools.py::"
                "test_an_out_of_memory_in_a_graph_pool_names_the_pool",
                "--deselect", "tests/alloc/arena/test_basic.py::"  # builds and runs a harness for this machine
                "test_the_device_totals_limit_is_not_passed_by_a_byte",
                "--deselect", "tests/alloc/plugin/test_graph_reuse.py::"  # hypothesis: not on that Python
                "test_record_stream_reuse_never_hands_out_a_block_its_graph_does_not_order_after_every_use")


def test_the_extension_builds_for_aarch64_and_runs_the_arenas_tests(core, tmp_path):
    arm.need(arm.python_missing())
    site = arm.build_extension(tmp_path, core())
    pure = arm.pure_site(tmp_path)
    done = arm.run_python(site, pure, "-c", (
        "import platform, alloc._lib as c, alloc\n"
        "from alloc import Arena\n"
        "with Arena(1 << 20) as a:\n"
        "    p = a.allocate(1000); a.free(p); a.check()\n"
        "print(platform.machine(), c.PATH)"))
    assert done.returncode == 0, done.stderr[-3000:]
    machine, extension = done.stdout.split()
    assert machine == "aarch64" and extension == str(site / "alloc" / arm.EXTENSION)
    print(f"aarch64 Python: {extension}")
    tests = arm.run_python(site, pure, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-o", f"pythonpath={site} .", *PYTHON_TESTS)
    assert tests.returncode == 0, tests.stdout[-5000:] + tests.stderr[-2000:]
    summary = tests.stdout.strip().splitlines()[-1]
    print(f"aarch64 Python: {summary}")
    assert " passed" in summary and "skipped" not in summary, tests.stdout[-2000:]
