"""Every argument of the Arena face across its whole type and range: the only outcomes are success
or the project's documented error, and after an error the arena is whole (its invariant walk
passes and its whole capacity can still be handed out). An int the C side cannot hold must never
be wrapped into one it can."""

import pytest
from hypothesis import given, settings, strategies as st

import alloc
from alloc import Arena, ArenaError, ArenaOutOfMemory
from alloc.arena import MAX_SIZE, U64_MAX

EDGES = [0, 1, -1, 255, 256, 4096, MAX_SIZE, MAX_SIZE + 1, 2**63, U64_MAX, 2**64, 2**64 + 4096, -(2**64)]
ANY = st.one_of(st.integers(-(1 << 70), 1 << 70), st.sampled_from(EDGES), st.booleans(),
                st.floats(allow_nan=True, allow_infinity=True), st.none(), st.text(max_size=3))
DOCUMENTED = (ValueError, ArenaError)  # ConfigError, InvalidFree, ArenaOutOfMemory... are ArenaErrors


def whole(arena: Arena) -> None:
    arena.check()
    p = arena.allocate(arena.capacity)
    arena.free(p)


@settings(max_examples=300, deadline=None)
@given(op=st.sampled_from(["allocate", "free", "owns", "record_stream", "complete", "waits"]),
       value=ANY, other=ANY, offset=st.sampled_from([None, 0, 2**64, -(2**64), 2**65]))
def test_every_argument_works_or_raises_a_documented_error(op, value, other, offset):
    with Arena(1 << 20) as a:
        live = a.allocate(4096)
        if offset is not None:  # the live block's address, or one that wraps onto it in 64 bits
            value = live + offset
        args = {"allocate": (value, other), "free": (value, other), "owns": (value,),
                "record_stream": (value, other), "complete": (value,), "waits": (value, other)}[op]
        try:
            result = getattr(a, op)(*args)
        except DOCUMENTED:
            result = None
        if op == "allocate" and isinstance(result, int) and result:
            a.free(result)
        freed = op == "free" and value == live and result is None and not a.blocks()[0].state == "used"
        if not freed:
            assert a.owns(live) and a.blocks()[0].state == "used", "the live block was touched"
            a.free(live)
        whole(a)


@settings(max_examples=200, deadline=None)
@given(capacity=ANY, alignment=ANY, growable=st.booleans(), region_min=ANY)
def test_an_arena_is_made_whole_or_refused_with_a_documented_error(capacity, alignment, growable, region_min):
    limit = 64 << 20
    try:
        a = Arena(capacity, alignment, growable=growable, region_min=region_min, host_limit=limit)
    except DOCUMENTED:
        return
    with a:
        assert a.capacity == a.stats()["capacity"] and a.capacity % a.alignment == 0
        if a.capacity:
            whole(a)
        elif region_min > limit:  # its first region is more than the host backend may reserve
            with pytest.raises(ArenaOutOfMemory, match="the backend could not reserve the memory"):
                a.allocate(4096)
            a.check()
        else:
            p = a.allocate(4096)
            a.free(p)
            a.check()


def test_the_capacity_reported_is_the_capacity_reserved():
    with Arena(1000, 4096) as a:
        assert a.capacity == 4096 == a.stats()["capacity"]
        assert "capacity 4.00 KiB" in repr(a)
    assert "closed" in repr(a)


@pytest.mark.parametrize("call", [lambda a: a.free(1.5), lambda a: a.allocate(True),
                                  lambda a: a.free(2**64), lambda a: a.owns(-1)])
def test_values_of_the_wrong_kind_are_refused_by_name(call):
    with Arena(1 << 20) as a, pytest.raises(ValueError, match="must be"):
        call(a)


def test_statistics_without_a_device_say_what_to_pass():
    pytest.importorskip("torch")
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is the current one here")
    with pytest.raises(ValueError, match="pass the device index"):
        alloc.memory_stats()
    assert alloc.memory_stats(0)["allocated_bytes.all.current"] == 0


def test_out_of_memory_is_the_documented_error():
    with Arena(1 << 20) as a, pytest.raises(ArenaOutOfMemory):
        a.allocate(MAX_SIZE + 1)


def test_an_address_range_that_cannot_be_reserved_is_named_not_the_capacity():
    with pytest.raises(ArenaOutOfMemory) as e:
        Arena(0, growable=True, address_range=2**62)
    assert "could not reserve an address range of 4194304.00 TiB (address_range=4611686018427387904) " \
           "from the host backend" in str(e.value) and "0 B" not in str(e.value)
    assert e.value.requested == 2**62


@settings(max_examples=60, deadline=None)
@given(address_range=st.one_of(st.integers(1, MAX_SIZE), st.sampled_from([2 << 20, 2**47, 2**48, 2**61, MAX_SIZE])),
       capacity=st.sampled_from([0, 2 << 20, 96 << 20]))
def test_a_mapping_arena_is_made_whole_or_its_refusal_names_the_range(address_range, capacity):
    try:
        a = Arena(capacity, growable=True, address_range=address_range, host_limit=64 << 20)
    except ValueError as e:
        assert capacity > address_range and f"capacity {capacity} is more than address_range {address_range}" in str(e)
        return
    except ArenaOutOfMemory as e:
        assert f"address range of {alloc.units.fmt_bytes(address_range)} (address_range={address_range})" in str(e)
        assert (f"with its first {alloc.units.fmt_bytes(capacity)} mapped" in str(e)) == bool(capacity)
        return
    with a:
        assert a.capacity >= capacity
        a.check()


def test_closing_while_other_threads_use_the_arena_never_touches_freed_memory():
    # Threads allocate, free, read statistics and walk blocks while the arena is closed under
    # them: every call either completes or raises "closed"; none may crash the interpreter.
    import threading
    for round_ in range(40):
        a = Arena(4 << 20, name=f"round {round_}")
        errors, started = [], threading.Barrier(5)

        def user(kind):
            started.wait()
            try:
                for _ in range(2000):
                    if kind == 0:
                        a.free(a.allocate(4096))
                    elif kind == 1:
                        a.stats()
                    elif kind == 2:
                        a.blocks()
                    else:
                        a.check()
            except ValueError as e:
                if "closed" not in str(e):
                    errors.append(e)
            except Exception as e:  # anything else is a defect
                errors.append(e)

        threads = [threading.Thread(target=user, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        started.wait()
        a.close()
        for t in threads:
            t.join()
        assert not errors, errors
        with pytest.raises(ValueError, match="closed"):
            a.stats()
