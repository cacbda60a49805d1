"""Random operation sequences against a model of the arena: the set of live intervals.

Because freed blocks merge at once, the arena's free blocks must be exactly the maximal gaps
between live blocks, and an allocation must succeed exactly when one gap can hold it. The free
block a free makes carries the requested bytes of the allocation it took back, as the free blocks
of PyTorch's snapshot do.
"""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from alloc import Arena, ArenaOutOfMemory, DoubleFree

CAPACITY = 64 << 10
ALIGN = 64


def gaps(live: dict[int, int], base: int) -> list[int]:
    out, cursor = [], base
    for start in sorted(live):
        if start > cursor:
            out.append(start - cursor)
        cursor = start + live[start]
    if cursor < base + CAPACITY:
        out.append(base + CAPACITY - cursor)
    return out


class ArenaMachine(RuleBasedStateMachine):
    blocks = Bundle("blocks")

    def __init__(self):
        super().__init__()
        self.arena = Arena(CAPACITY, alignment=ALIGN)
        self.base = self.arena.regions()[0].base
        self.live: dict[int, int] = {}
        self.streams = {}
        self.requested: dict[int, int] = {}
        self.freed: list[int] = []

    def teardown(self):
        self.arena.close()

    @rule(target=blocks, size=st.one_of(st.integers(1, 4096), st.integers(1, CAPACITY + 64)),
          stream=st.integers(0, 3))
    def allocate(self, size, stream):
        rounded = -(-size // ALIGN) * ALIGN
        fits = any(g >= rounded for g in gaps(self.live, self.base))
        try:
            p = self.arena.allocate(size, stream)
        except ArenaOutOfMemory:
            assert not fits, f"refused {rounded} bytes with gaps {gaps(self.live, self.base)}"
            return None
        assert fits
        assert p % ALIGN == 0 and self.base <= p and p + rounded <= self.base + CAPACITY
        for start, length in self.live.items():
            assert p + rounded <= start or start + length <= p, "overlaps a live block"
        self.live[p] = rounded
        self.streams[p] = stream
        self.requested[p] = size
        return p

    @rule(p=consumes(blocks), stream=st.integers(0, 3))
    def free(self, p, stream):
        if p is None:
            return
        self.arena.free(p, stream)
        del self.live[p]
        self.freed.append(p)
        (covering,) = [b for b in self.arena.blocks() if b.address <= p < b.address + b.size]
        assert covering.state == "free" and covering.requested == self.requested.pop(p)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def double_free(self, data):
        p = data.draw(st.sampled_from(self.freed))
        if p in self.live:
            return
        before = self.arena.blocks()
        try:
            self.arena.free(p)
        except DoubleFree:
            pass
        else:
            raise AssertionError("a double free was accepted")
        assert self.arena.blocks() == before

    @invariant()
    def matches_model(self):
        self.arena.check()
        s = self.arena.stats()
        g = gaps(self.live, self.base)
        assert s["in_use"] == sum(self.live.values())
        assert s["blocks"] == len(self.live)
        assert s["free_bytes"] == CAPACITY - s["in_use"]
        # Freed blocks merge at once: the free blocks are the gaps.
        assert s["free_blocks"] == len(g)
        assert s["largest_free"] == max(g, default=0)
        used = [(b.address, b.size, b.requested) for b in self.arena.blocks() if b.state == "used"]
        assert {a: size for a, size, _ in used} == self.live
        assert {a: requested for a, _, requested in used} == self.requested
        assert all(b.requested <= b.size for b in self.arena.blocks())  # free blocks too


TestArenaMachine = ArenaMachine.TestCase
TestArenaMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
