"""Every stream value a caller can pass: ordered, or refused before it reaches the core (hypothesis,
so apart from test_streams.py, which the aarch64 Python without hypothesis runs)."""

import pytest
from hypothesis import given, settings, strategies as st

from alloc import Arena

KiB, MiB = 1 << 10, 1 << 20
U64 = 2**64 - 1


STREAMS = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**63, 2**64 - 2, 2**64 - 1]))


@settings(max_examples=200, deadline=None)
@given(first=STREAMS, second=STREAMS)
def test_every_stream_a_caller_can_pass_is_ordered_or_refused_at_the_boundary(first, second):
    # Issue 47: stream 2**64 - 1 is the core's "no stream" (IA_STREAM_NONE). A block allocated and
    # freed on it carried "ordered after nothing", and another stream took it without a wait.
    # Every stream value either keeps its ordering (a block freed on one stream and taken by
    # another makes the taker wait) or is refused before it reaches the core, in one line.
    with Arena(MiB) as a:
        a.set_auto_complete(False)
        if U64 in (first, second):
            bad = first if first == U64 else second
            if first != U64:
                a.free(a.allocate(64 * KiB, first), first)
            with pytest.raises(ValueError, match=r"^stream must be from 0 to 18446744073709551614, got "):
                a.allocate(64 * KiB, bad)
            return
        p = a.allocate(64 * KiB, first)
        a.free(p, first)
        q = a.allocate(64 * KiB, second)
        assert q == p
        assert a.waits(second, first) == (first != second)
        a.free(q, second)
        a.check()


def test_the_core_refuses_the_no_stream_value_wherever_a_stream_enters_it():
    from alloc._lib import ffi, lib
    with Arena(MiB) as a:
        h, out, none = a._arena, ffi.new("void **"), 2**64 - 1
        assert lib.ia_arena_alloc(h, 4096, none, out) == lib.IA_ERR_INVALID_ARGUMENT
        assert lib.ia_arena_alloc_cached(h, 4096, none, out) == lib.IA_ERR_INVALID_ARGUMENT
        p = a.allocate(4096, 1)
        assert lib.ia_arena_record_stream(h, ffi.cast("void *", p), none) == lib.IA_ERR_INVALID_ARGUMENT
        a.free(p, 1)
        assert lib.ia_arena_alloc_at(h, ffi.cast("void *", p), 4096, none) == lib.IA_ERR_INVALID_ARGUMENT
        assert a.stats()["blocks"] == 0
