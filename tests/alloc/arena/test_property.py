"""Random operation sequences against a model of the arena: the set of live intervals.

Because freed blocks merge at once, the arena's free blocks must be exactly the maximal gaps
between live blocks, and an allocation must succeed exactly when one gap can hold it. The same
machine runs again with a thread cache (CachedArenaMachine), where the second half still holds.
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
        self.arena = self.make_arena()
        self.base = self.arena.regions()[0].base
        self.live: dict[int, int] = {}
        self.streams = {}
        self.freed: list[int] = []

    def teardown(self):
        self.arena.close()

    def make_arena(self) -> Arena:
        return Arena(CAPACITY, alignment=ALIGN)

    def held(self, p: int, rounded: int) -> int:
        """The bytes the block at p holds, for a request rounded to `rounded`: exactly that here."""
        return rounded

    def free_blocks_match(self, stats: dict, gaps_now: list[int]) -> None:
        """Freed blocks merge at once: the free blocks are the gaps."""
        assert stats["free_blocks"] == len(gaps_now)
        assert stats["largest_free"] == max(gaps_now, default=0)

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
        held = self.held(p, rounded)
        assert p % ALIGN == 0 and self.base <= p and p + held <= self.base + CAPACITY
        for start, length in self.live.items():
            assert p + held <= start or start + length <= p, "overlaps a live block"
        self.live[p] = held
        self.streams[p] = stream
        return p

    @rule(p=consumes(blocks), stream=st.integers(0, 3))
    def free(self, p, stream):
        if p is None:
            return
        self.arena.free(p, stream)
        del self.live[p]
        self.freed.append(p)

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
        self.free_blocks_match(s, g)
        used = [(b.address, b.size) for b in self.arena.blocks() if b.state == "used"]
        assert dict(used) == self.live


TestArenaMachine = ArenaMachine.TestCase
TestArenaMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


class CachedArenaMachine(ArenaMachine):
    """The same sequences with a thread cache (csrc/thread_cache.c) small enough to be trimmed
    often. What still holds: an allocation succeeds exactly when a gap of the live blocks holds it
    (the arena takes cached blocks back before it refuses), and the counters and the used blocks
    match the model. What changes: a block handed out is the request rounded, or less than 3/32
    over it from 512 bytes on; a cached block is free but merges with nothing, so the free blocks
    are no longer the gaps. Streams 0 to 3 on one thread make the cache scan past other streams'
    blocks and take blocks out of the middle of its lists."""

    def make_arena(self) -> Arena:
        return Arena(CAPACITY, alignment=ALIGN, thread_cache=8 << 10, thread_cache_block=4 << 10)

    def held(self, p: int, rounded: int) -> int:
        held = {b.address: b.size for b in self.arena.blocks() if b.state == "used"}[p]
        assert rounded <= held and (held == rounded or (rounded >= 512 and held * 32 < rounded * 35))
        return held

    def free_blocks_match(self, stats: dict, gaps_now: list[int]) -> None:
        pass


TestCachedArenaMachine = CachedArenaMachine.TestCase
TestCachedArenaMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
