"""Thread caches (csrc/thread_cache.c) seen from Python: what a cached block counts as, stream
order, frees from other threads, thread exit, and what must take cached blocks back. The threaded
C harnesses are in tests/csrc/test_harnesses.py."""

import ctypes
import os
import platform
import sys
import threading
import time
import warnings

import pytest
from hypothesis import given, settings, strategies as st

from alloc import Arena, DoubleFree
from alloc._core import ffi, lib

KiB, MiB = 1 << 10, 1 << 20
S1, S2 = 1, 2
MEMBARRIER_SYSCALL = {"x86_64": 324, "aarch64": 283}
MEMBARRIER_PRIVATE_EXPEDITED = 1 << 3


def cached_arena(capacity=MiB, **kw):
    kw.setdefault("thread_cache", 2 * MiB)
    kw.setdefault("thread_cache_block", MiB)
    return Arena(capacity, **kw)


def one_free_block(arena, timeout=30.0) -> bool:
    """Whether the arena comes back to one free block. Python's join() returns before the thread
    has finished at the C level, where its cache is given back (a pthread key's destructor), so
    the test waits for that, boundedly."""
    deadline = time.monotonic() + timeout
    while True:
        blocks = arena.blocks()
        if len(blocks) == 1 and blocks[0].state == "free":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def in_thread(fn):
    """Runs fn on a new thread that ends before this returns (its cache goes with it)."""
    out, errors = [], []

    def body():
        try:
            out.append(fn())
        except BaseException as e:  # handed back to the test
            errors.append(e)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return out[0]


def test_a_cached_block_counts_as_free_and_is_reused_on_its_stream():
    with cached_arena() as a:
        a.set_auto_complete(False)
        p = a.allocate(65 * KiB, S1)
        q = a.allocate(64 * KiB, S1)  # p's neighbour: in an uncached arena p would merge on free
        a.free(p, S1)
        s = a.stats()
        assert s["in_use"] == 64 * KiB and s["blocks"] == 1 and s["requested"] == 64 * KiB
        assert s["free_bytes"] == MiB - 64 * KiB and s["free_blocks"] == 2  # p, kept whole, and the rest
        assert s["blocks_freed"] == 1 and s["blocks_allocated"] == 2 and s["in_use_peak"] == 129 * KiB
        assert [b.state for b in a.blocks()] == ["free", "used", "free"]
        # Same stream, same size class (64 to 66 KiB): p again, whole, with no event and no wait.
        assert a.allocate(64 * KiB + 256, S1) == p
        s = a.stats()
        assert s["event_records"] == 0 and s["stream_waits"] == 0
        assert s["in_use"] == 129 * KiB and s["requested"] == 128 * KiB + 256 and s["blocks_allocated"] == 3
        assert a.allocate(63 * KiB, S1) not in (p, q)  # another class: from the arena
        a.free(p, S1)
        a.free(q, S1)
        a.check()


def test_a_request_takes_a_cached_block_up_to_two_classes_above_its_own():
    """A 65 KiB block is in the class from 64 to 66 KiB, below which classes are 1 KiB wide: it
    serves requests from 62 KiB on (its class and the two below), not 61.75 KiB, and in_use counts
    the whole block it hands out."""
    with cached_arena() as a:
        p = a.allocate(65 * KiB, S1)
        a.allocate(KiB, S1)  # p's neighbour, so that p stays a block of its own
        a.free(p, S1)
        assert a.allocate(62 * KiB, S1) == p
        assert a.stats()["in_use"] == 66 * KiB and a.stats()["requested"] == 63 * KiB
        a.free(p, S1)
        other = a.allocate(61 * KiB + 768, S1)  # three classes below: from the arena
        assert other != p
        a.free(other, S1)
        a.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 600) | st.integers(1, 300 * KiB), st.booleans()), min_size=1, max_size=80),
       st.sampled_from([16, 256]))
def test_a_cached_block_is_less_than_three_32nds_larger_than_asked(steps, alignment):
    """Whatever the sequence, a block handed out is the request rounded to the alignment, or less
    than 3/32 larger for 512 bytes and up (the first level's classes are exact sizes)."""
    with cached_arena(capacity=8 * MiB, alignment=alignment) as a:
        live = []
        for size, free_one in steps:
            if free_one and live:
                a.free(live.pop(len(live) // 2), S1)
            p = a.allocate(size, S1)
            live.append(p)
            rsize = -(-size // alignment) * alignment
            got = next(b.size for b in a.blocks() if b.address == p)
            assert rsize <= got and (got == rsize if rsize < 512 else 32 * got < 35 * rsize), (size, got)
        for p in live:
            a.free(p, S1)
        a.check()


def test_another_stream_gets_a_cached_block_only_after_waiting_for_its_free():
    with cached_arena(256 * KiB) as a:
        a.set_auto_complete(False)
        p = a.allocate(128 * KiB, S1)
        q = a.allocate(128 * KiB, S1)  # the arena is full
        a.free(p, S1)  # kept by this thread's cache, freed on S1
        # S2 may not take it from the cache; the arena has nothing else, so it takes the caches'
        # blocks back and hands p to S2 behind S1's event.
        assert a.allocate(128 * KiB, S2) == p
        assert a.waits(S2, S1) == 1 and a.stats()["stream_waits"] == 1
        a.free(p, S2)
        a.free(q, S1)
        a.check()


def test_a_long_class_list_of_other_streams_is_not_scanned_to_its_end():
    with cached_arena(4 * MiB) as a:
        ps = [a.allocate(64 * KiB, S1) for _ in range(12)]
        for p in ps:  # one class list of the cache, all on S1
            a.free(p, S1)
        q = a.allocate(64 * KiB, S2)  # looks at a few of them, then asks the arena
        assert q not in ps
        assert a.allocate(64 * KiB, S1) == ps[-1]  # the newest first
        a.free(q, S2)
        a.free(ps[-1], S1)
        a.check()


def test_a_block_with_recorded_streams_is_not_kept_by_the_cache():
    with cached_arena() as a:
        a.set_auto_complete(False)
        p = a.allocate(64 * KiB, S1)
        a.record_stream(p, S2)
        a.free(p, S1)  # through the arena: S1 must wait for S2's use first
        assert a.waits(S1, S2) == 1
        assert [b.state for b in a.blocks()] == ["free"]  # merged at once, as without a cache
        a.check()


def test_a_stream_recorded_by_another_thread_orders_the_owners_free():
    """record_stream from a thread that does not own the block's cache (it claims nothing): the
    owner's free then goes through the arena and orders its stream after the recorded one."""
    with cached_arena() as a:
        a.set_auto_complete(False)
        blocks = {}
        allocated, recorded = threading.Event(), threading.Event()

        def owner():
            blocks["p"] = a.allocate(48 * KiB, S1)
            allocated.set()
            assert recorded.wait(timeout=60)
            a.free(blocks["p"], S1)  # another stream recorded on it: through the arena's lock

        t = threading.Thread(target=owner)
        t.start()
        assert allocated.wait(timeout=60)
        a.record_stream(blocks["p"], S2)
        recorded.set()
        t.join()
        assert a.waits(S1, S2) == 1
        assert one_free_block(a)
        a.check()


def test_double_frees_of_a_cached_block_are_refused_on_every_thread():
    with cached_arena() as a:
        p = a.allocate(4 * KiB)
        a.free(p)
        with pytest.raises(DoubleFree):
            a.free(p)
        with pytest.raises(DoubleFree):
            in_thread(lambda: a.free(p))
        with pytest.raises(DoubleFree):
            a.record_stream(p, S2)
        assert a.stats()["bad_frees"] == 2  # the two frees; record_stream counts no free
        a.check()


def test_blocks_allocated_on_one_thread_free_on_another():
    with cached_arena(32 * MiB) as a:
        sizes = [256, 4 * KiB, 64 * KiB, 300 * KiB, 3 * MiB]  # the last is past thread_cache_block
        go, done = threading.Event(), threading.Event()
        made = []

        def owner():
            for size in sizes * 4:
                made.append(a.allocate(size))
            for p in made[::2]:  # some freed here first: they sit in this thread's cache
                a.free(p)
            go.set()
            done.wait()
            return [a.allocate(size) for size in sizes]  # reuse after the other thread's frees

        t = threading.Thread(target=owner)
        t.start()
        assert go.wait(timeout=60)
        for p in made[1::2]:  # blocks lent to the other thread's cache, freed from this one
            a.free(p)
        a.check()
        assert a.stats()["blocks"] == 0
        done.set()
        t.join()
        a.check()
        left = [b for b in a.blocks() if b.state == "used"]
        assert len(left) == len(sizes)
        for b in left:  # and the owner's last blocks, allocated by a thread that has ended
            a.free(b.address)
        assert one_free_block(a)


def test_a_block_freed_by_another_thread_is_free_at_once_and_refused_a_second_time():
    """Another thread's free of a block lent to a cache waits on the cache's remote frees for the
    arena to complete it; from outside it is free at once, and every second free is refused: the
    owner's first (before anything completes the frees), then the freeing thread's."""
    with cached_arena(4 * MiB) as a:
        allocated, freed = threading.Event(), threading.Event()
        ps, refused = [], []

        def owner():
            ps.extend(a.allocate(size) for size in (512, 48 * KiB, 400 * KiB))
            allocated.set()
            assert freed.wait(timeout=60)
            a.check()  # the walk sees them waiting on the cache's remote frees, and completes none
            for p in ps:
                try:
                    a.free(p)
                except DoubleFree:  # its message looks at the arena, which completes the frees
                    refused.append(p)

        t = threading.Thread(target=owner)
        t.start()
        assert allocated.wait(timeout=60)
        for p in ps:
            a.free(p)
        freed.set()
        t.join()
        assert refused == ps
        for p in ps:
            with pytest.raises(DoubleFree):
                a.free(p)
            with pytest.raises(DoubleFree):
                a.record_stream(p, S2)
        s = a.stats()
        assert s["in_use"] == 0 and s["blocks"] == 0 and s["bad_frees"] == 2 * len(ps)
        a.check()
        assert one_free_block(a)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_can_claim_the_caches_of_threads_it_does_not_have():
    """After fork only the forking thread runs; the other threads' caches are still the arena's,
    and the child's statistics and invariant walk claim them (the barrier, in the child)."""
    with cached_arena(8 * MiB) as a:
        kept, finish = threading.Event(), threading.Event()

        def worker():
            ps = [a.allocate(size) for size in (4 * KiB, 64 * KiB, 300 * KiB)]
            a.free(ps[0])
            a.free(ps[2])  # two kept in this thread's cache, one handed out
            kept.set()
            finish.wait()
            a.free(ps[1])

        t = threading.Thread(target=worker)
        t.start()
        assert kept.wait(timeout=60)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # forking with threads running
            pid = os.fork()
        if pid == 0:
            try:
                s = a.stats()
                a.check()
                os._exit(0 if s["in_use"] == 64 * KiB and s["free_bytes"] == 8 * MiB - 64 * KiB else 1)
            except BaseException:
                os._exit(2)
        deadline = time.monotonic() + 60
        while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        if not done[0]:  # a claim waiting forever in the child
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        status = done[1]
        finish.set()
        t.join()
        assert done[0] and os.waitstatus_to_exitcode(status) == 0
        assert one_free_block(a)


def test_the_cache_protocol_is_the_barrier_where_linux_offers_it():
    """A cache's owner enters it with a store and a load where membarrier's private expedited
    command exists, and with an atomic exchange elsewhere (csrc/thread_cache_claims.c)."""
    expected = "exchange"
    if sys.platform == "linux" and platform.machine() in MEMBARRIER_SYSCALL:
        libc = ctypes.CDLL(None, use_errno=True)
        commands = libc.syscall(MEMBARRIER_SYSCALL[platform.machine()], 0, 0, 0)  # MEMBARRIER_CMD_QUERY
        if commands > 0 and commands & MEMBARRIER_PRIVATE_EXPEDITED:
            expected = "membarrier"
    assert ffi.string(lib.ia_thread_cache_protocol()).decode() == expected


def test_a_thread_gives_its_cached_blocks_back_when_it_ends():
    with cached_arena(4 * MiB) as a:
        freed, finish = threading.Event(), threading.Event()

        def worker():
            ps = [a.allocate(size) for size in (1000, 20 * KiB, 20 * KiB, 200 * KiB, 700 * KiB)]
            for p in ps:
                a.free(p)
            freed.set()
            finish.wait()

        t = threading.Thread(target=worker)
        t.start()
        assert freed.wait(timeout=60)
        s = a.stats()
        assert s["in_use"] == 0 and s["free_bytes"] == 4 * MiB and s["free_blocks"] > 1
        a.check()
        finish.set()
        t.join()
        assert one_free_block(a) and a.stats()["free_blocks"] == 1


def test_a_request_the_arena_cannot_serve_takes_back_only_what_it_needs():
    with cached_arena(2 * MiB) as a:
        ps = [a.allocate(512 * KiB, S1) for _ in range(4)]  # the arena is full
        for p in ps:
            a.free(p, S1)  # all four kept by this thread's cache
        q = a.allocate(512 * KiB, S2)  # not S2's to reuse from the cache: the arena takes one back
        assert q in ps
        s = a.stats()
        assert s["free_blocks"] == 3 and s["free_bytes"] == 3 * 512 * KiB  # the other three still cached
        a.free(q, S2)
        a.check()


def test_a_cache_past_its_limit_gives_back_its_largest_blocks_first():
    """thread_cache 2 MiB: a cache keeping more than a quarter over that is trimmed back to it,
    largest class first. What it gave back serves another stream from the arena; what it kept
    serves its own stream."""
    with cached_arena(8 * MiB, thread_cache=2 * MiB) as a:
        large = [a.allocate(MiB, S1) for _ in range(2)]
        small = [a.allocate(256 * KiB, S1) for _ in range(3)]
        a.allocate(KiB, S1)  # ends the run of blocks, so that none merges with the arena's rest
        for p in large + small:
            a.free(p, S1)  # 2.75 MiB after the last: one 1 MiB block goes back, 1.75 MiB stay
        back = a.allocate(MiB, S2)
        assert back in large
        assert a.allocate(256 * KiB, S2) not in small  # still cached, for S1 alone
        kept = [p for p in large if p != back]
        assert a.allocate(MiB, S1) == kept[0]
        assert sorted(a.allocate(256 * KiB, S1) for _ in range(3)) == sorted(small)
        a.check()


def test_cached_blocks_never_make_a_growable_arena_grow():
    with cached_arena(0, growable=True, region_min=2 * MiB) as a:
        ps = [a.allocate(512 * KiB) for _ in range(4)]  # one 2 MiB region, full
        for p in ps:
            a.free(p)  # cached, unmerged: no single block holds 1.5 MiB
        big = a.allocate(3 * 512 * KiB)  # they come back and merge before the arena may grow
        s = a.stats()
        assert s["capacity"] == 2 * MiB and s["regions"] == 1 and s["backend_reserves"] == 1
        a.free(big)
        a.check()


def test_release_cached_takes_cached_blocks_back_first():
    with cached_arena(0, growable=True, region_min=2 * MiB) as a:
        p = a.allocate(256 * KiB)
        a.free(p)  # the region is free but for p, which this thread keeps
        assert a.release_cached() == 2 * MiB
        assert a.stats()["capacity"] == 0
        a.check()


def test_allocation_at_an_address_takes_cached_blocks_back_first():
    with cached_arena() as a:
        p = a.allocate(64 * KiB)
        q = a.allocate(64 * KiB)
        a.free(p)  # kept in the cache: not free to the arena until taken back
        with a._use() as h:
            assert lib.ia_arena_alloc_at(h, ffi.cast("void *", p + 4 * KiB), 8 * KiB, 0) == lib.IA_OK
        assert [(b.offset, b.state) for b in a.blocks()][:3] == [(0, "free"), (4 * KiB, "used"), (12 * KiB, "free")]
        a.free(p + 4 * KiB)
        a.free(q)
        a.check()


def test_an_arena_closed_while_another_thread_holds_its_cache():
    holding, closed = threading.Event(), threading.Event()
    a = cached_arena()

    def worker():
        p = a.allocate(64 * KiB)
        a.free(p)  # cached
        holding.set()
        closed.wait()
        # The closed arena's cache is an orphan now; a new arena (perhaps at the same address)
        # must get a cache of its own, and the thread's exit must not touch the old one.
        with cached_arena() as b:
            q = b.allocate(64 * KiB)
            b.free(q)
            b.check()
            return b.stats()["free_blocks"]

    t_result = []
    t = threading.Thread(target=lambda: t_result.append(worker()))
    t.start()
    assert holding.wait(timeout=60)
    a.close()
    closed.set()
    t.join()
    assert t_result == [2]  # q kept by the worker's new cache, beside the rest


def test_thread_cache_arguments_are_checked():
    for bad in (-1, 1.5, 1 << 63):
        with pytest.raises(ValueError):
            Arena(MiB, thread_cache=bad)
        with pytest.raises(ValueError):
            Arena(MiB, thread_cache_block=bad)
    with Arena(MiB, thread_cache=MiB, thread_cache_block=0) as a:  # nothing could be kept: off
        p = a.allocate(4 * KiB)
        a.free(p)
        assert a.stats()["free_blocks"] == 1
