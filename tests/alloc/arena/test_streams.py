"""Stream-safe reuse on the host backend, whose events complete only when the test says so."""

import pytest

from alloc import Arena

KiB, MiB = 1 << 10, 1 << 20
S1, S2, S3 = 1, 2, 3


@pytest.fixture
def arena():
    with Arena(MiB) as a:
        a.set_auto_complete(False)
        yield a
        a.check()


def test_same_stream_reuses_at_once_without_events(arena):
    p = arena.allocate(64 * KiB, S1)
    arena.free(p, S1)
    assert arena.allocate(64 * KiB, S1) == p
    s = arena.stats()
    assert s["event_records"] == 0 and s["stream_waits"] == 0


def test_cross_stream_reuse_waits_for_the_free(arena):
    p = arena.allocate(64 * KiB, S1)
    arena.free(p, S1)
    # The block freed on S1 is reused by S2 only after S2 is made to wait on S1's event.
    q = arena.allocate(64 * KiB, S2)
    assert q == p
    assert arena.waits(S2, S1) == 1
    assert arena.stats()["event_records"] == 1 and arena.stats()["stream_waits"] == 1
    arena.free(q, S2)


def test_completed_event_needs_no_wait(arena):
    p = arena.allocate(64 * KiB, S1)
    arena.free(p, S1)
    arena.allocate(4 * KiB, S3)  # records S1's event (now pending) and waits
    assert arena.waits(S3, S1) == 1
    arena.complete(S1)
    q = arena.allocate(4 * KiB, S2)  # S1's event has completed since: no new wait
    assert arena.waits(S2, S1) == 0
    assert arena.stats()["event_records"] == 1  # the completed event is reused, not re-recorded
    arena.free(q, S2)


def test_a_new_free_needs_a_new_record(arena):
    p = arena.allocate(64 * KiB, S1)
    arena.free(p, S1)
    q = arena.allocate(64 * KiB, S2)
    arena.complete(S1)
    arena.free(q, S2)
    r = arena.allocate(64 * KiB, S1)  # freed on S2 since, and S2 has not completed
    assert arena.waits(S1, S2) == 1
    arena.free(r, S1)
    assert arena.stats()["event_records"] == 2


def test_merging_blocks_of_two_streams_orders_them(arena):
    a = arena.allocate(64 * KiB, S1)
    b = arena.allocate(64 * KiB, S2)
    c = arena.allocate(64 * KiB, S1)  # keeps b's right neighbour live
    arena.free(a, S1)
    arena.free(b, S2)  # merges with a (freed on S1): S2 must wait on S1
    assert arena.waits(S2, S1) == 1
    merged = arena.blocks()[0]
    assert merged.state == "free" and merged.size == 128 * KiB and merged.stream == S2
    arena.free(c, S1)


def test_record_stream_orders_the_other_users_before_reuse(arena):
    p = arena.allocate(64 * KiB, S1)
    arena.record_stream(p, S2)
    arena.record_stream(p, S2)  # recording twice is the same as once
    arena.record_stream(p, S1)  # its own stream needs no record
    arena.free(p, S1)
    # freeing made S1 wait on S2's work so far; S1 may then reuse it at once
    assert arena.waits(S1, S2) == 1
    assert arena.allocate(64 * KiB, S1) == p
    assert arena.waits(S1, S2) == 1


def test_auto_complete_needs_no_waits():
    with Arena(MiB) as a:
        p = a.allocate(64 * KiB, S1)
        a.free(p, S1)
        a.allocate(64 * KiB, S2)
        assert a.waits(S2, S1) == 0 and a.stats()["event_records"] == 1


def test_stream_controls_need_the_host_backend():
    with Arena(MiB) as a:
        a.complete(S1)  # host: fine
    with pytest.raises(ValueError, match="closed"):
        a.complete(S1)

