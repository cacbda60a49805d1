"""PyTorch's graph_capture_record_stream_reuse in the C core, on the host backend: a graph pool's
block freed inside a capture while other capturing streams used it comes back on its own stream
once the capture's graph orders their work before that stream's next, never sooner. The host
backend simulates the capture's graph: launch(s) captures work on s, join(waiter, waited) is
waiter.wait_stream(waited). Each test runs in a fresh interpreter (test_graph_pools.py's
prelude) and ends with no capture rule broken and every pool arena's invariants holding."""

import pytest

from tests.alloc.plugin.test_graph_pools import run

REUSE = """
launch = lib.ia_host_capture_launch


def join(waiter, waited):
    assert lib.ia_host_capture_wait(waiter, waited)


def record(ptr, s):
    lib.ia_torch_record_stream(ffi.cast("void *", ptr), stream(s))
"""


@pytest.mark.parametrize("reuse", [True, False])
def test_a_block_other_streams_used_is_reused_in_the_capture_once_its_graph_joins_them(reuse):
    # PyTorch's test_graph_capture_reclaim_2_streams on the host backend; off, the block waits for
    # the capture's end as it always did.
    run(REUSE + f"""
lib.ia_graph_set_record_stream_reuse({reuse})
p = pool(21)
capture(p, 60, 7)
sink = alloc(4096, 60, p)
data1 = alloc(4096, 60, p)
join(61, 60)                          # s2 forks from s1 and reads data1
buf2 = alloc(4096, 61, p)
launch(61)
record(data1, 61)
free(data1)
data2 = alloc(4096, 60, p)            # s2 not joined back: never data1's block
join(60, 61)
launch(60)
data3 = alloc(4096, 60, p)
assert data2 != data1 and (data3 == data1) == {reuse}, (data1, data2, data3)
lib.ia_host_capture_end(61)
end_capture(p, 60)
check(p)
""")


def test_a_block_is_reused_only_once_every_stream_that_used_it_is_joined():
    # PyTorch's test_graph_capture_reclaim_4_streams: partial joins are not enough.
    run(REUSE + """
lib.ia_graph_set_record_stream_reuse(True)
p = pool(22)
capture(p, 70, 8)
data1 = alloc(4096, 70, p)
launch(70)                            # torch.ones
sink1, sink3 = alloc(4096, 70, p), alloc(4096, 70, p)
for s in (71, 72, 73):                # three forks read data1
    join(s, 70)
    alloc(4096, s, p)
    launch(s)
    record(data1, s)
free(data1)
join(70, 71)
launch(70)
join(72, 73)
launch(72)
data2 = alloc(4096, 70, p)            # s1 and s3 not yet joined together
join(70, 72)
launch(70)
data3 = alloc(4096, 70, p)
assert data2 != data1 and data3 == data1, (data1, data2, data3)
for s in (71, 72, 73):
    lib.ia_host_capture_end(s)
end_capture(p, 70)
check(p)
""")


def test_a_block_used_outside_the_capture_or_on_another_stream_is_not_reused_early():
    run(REUSE + """
lib.ia_graph_set_record_stream_reuse(True)
p = pool(23)
capture(p, 80, 9)
a = alloc(4096, 80, p)
b = alloc(4096, 80, p)
launch(80)
record(a, 85)                         # a stream outside the capture: no graph orders it
join(81, 80)
launch(81)
record(b, 81)
free(a)
free(b)
join(80, 81)
launch(80)
c = alloc(4096, 81, p)                # b's own stream is 80: an allocation on 81 never takes it
d = alloc(4096, 80, p)                # b comes back here; a waits for the end of the capture
assert d == b and a not in (c, d), (a, b, c, d)
lib.ia_host_capture_end(81)
end_capture(p, 80)
e = [alloc(4096, 80, p) for _ in range(4)]
check(p)
""")


def test_record_stream_reuse_never_hands_out_a_block_its_graph_does_not_order_after_every_use():
    pytest.importorskip("hypothesis")
    # Random captures over four streams (work, joins, allocations, record_stream, frees), checked
    # against a model of the capture graph: a block freed inside the capture comes back only to
    # its own stream, only once every node its streams had captured when it was freed precedes
    # that stream's next work; and once everything is joined, every such block has come back.
    run(REUSE + """
from hypothesis import given, settings, strategies as st, HealthCheck

lib.ia_graph_set_record_stream_reuse(True)
S = [100, 101, 102, 103]
# (kind, stream, other stream, which live block, size), the kinds weighted toward what makes a
# block used by several capturing streams and freed between partial joins
op = st.tuples(st.sampled_from(["launch"] * 3 + ["join"] * 2 + ["alloc"] * 3 + ["record"] * 3 + ["free"] * 2),
               st.sampled_from(S), st.sampled_from(S), st.integers(0, 63), st.sampled_from([512, 4096, 3 * MiB]))
counter = iter(range(1000, 10**6))
live_in = live                        # the prelude's: the pool's live blocks


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(S[1:])), st.lists(op, min_size=20, max_size=120))
def program(forks, ops):
    n = next(counter)
    p = pool(n)
    capture(p, S[0], n)
    frontier = {S[0]: set()}          # the model: each capturing stream's frontier
    live = {}                         # address -> (size, stream, streams recorded)
    ops = [("join", f, S[0], 0, 0) for f in forks] + ops   # most captures fork their streams first
    try:
        run_program(ops, p, frontier, live)
    finally:
        for s in frontier:
            lib.ia_host_capture_end(s)
        assert lib.ia_graph_end(0, p[0]) == lib.IA_OK
        check(p)
        for addr in live:
            free(addr)
        assert lib.ia_graph_release(0, p[0]) == lib.IA_OK
        assert info(p) is None        # every block came back and the pool went


def run_program(ops, p, frontier, live):
    parents = {}
    held = {}                         # address -> (size, stream, markers)

    def ancestors(s):
        seen, todo = set(), list(frontier[s])
        while todo:
            v = todo.pop()
            if v not in seen:
                seen.add(v)
                todo.extend(parents[v])
        return seen

    for kind, s, other, pick, size in ops:
        if kind == "launch" and s in frontier:
            node = launch(s)
            parents[node] = frontier[s]
            frontier[s] = {node}
        elif kind == "join" and other in frontier and s != other:
            join(s, other)
            frontier[s] = frontier.get(s, set()) | frontier[other]
        elif kind == "alloc" and s in frontier:
            reachable = ancestors(s)
            for addr, (_, own, markers) in list(held.items()):
                if own == s and markers and markers <= reachable:
                    del held[addr]    # may come back now
            live[alloc(size, s, p)] = (size, s, set())
        elif kind == "record" and live:
            addr = sorted(live)[pick % len(live)]
            if s != live[addr][1]:
                record(addr, s)
                live[addr][2].add(s)
        elif kind == "free" and live:
            addr = sorted(live)[pick % len(live)]
            size, own, used = live.pop(addr)
            free(addr)
            if used:
                capturing = all(u in frontier for u in used)
                markers = set().union(*(frontier[u] for u in used | {own})) if capturing else set()
                held[addr] = (size, own, markers)
        # Exactly the model's blocks are live in the pool: none came back early, none late.
        assert live_in(p) == sorted([*live, *held]), (kind, s, live_in(p), sorted(live), sorted(held))
    # Join every stream into the first, capture on it, allocate: what its graph now orders comes back.
    for s in list(frontier):
        if s != S[0]:
            join(S[0], s)
    launch(S[0])
    live[alloc(512, S[0], p)] = (512, S[0], set())
    kept = [addr for addr, (_, own, markers) in held.items() if own != S[0] or not markers]
    assert live_in(p) == sorted([*live, *kept])


program()
""")
