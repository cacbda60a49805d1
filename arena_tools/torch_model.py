"""A model of PyTorch's default CUDA caching allocator, one device and one stream.

It follows ``DeviceCachingAllocator`` in c10/cuda/CUDACachingAllocator.cpp (torch 2.x; recent main
moves the same logic into the device-generic ``CachingDeviceAllocatorImpl`` template in c10/core)
with the settings of c10/core/AllocatorConfig.h. What it keeps, with the constants of the real code:

- request rounding: below 512 bytes -> 512, otherwise up to a multiple of 512
  (``roundup_power2_divisions``, off by default, can round to power-of-two divisions instead);
- two pools: requests <= 1 MiB live in 2 MiB segments (small pool); larger ones in the large pool,
  where a new segment is 20 MiB for requests under 10 MiB and the request rounded up to 2 MiB
  otherwise;
- best fit: the free block with the smallest (size, address) not below the request (the real key
  is (stream, size, address), or (size, stream, address) in recent main: the same with one stream);
- splitting: a found block is cut when the rest is >= 512 bytes (small pool) or > 1 MiB (large
  pool, and only for requests below ``max_split_size``, unlimited by default);
- with ``max_split_size`` set, blocks at or above it are not handed to smaller requests and serve
  larger ones only within ``max_non_split_rounding`` (20 MiB default);
- a freed block merges with free neighbours of its own segment and stays cached: segments go back
  to the driver only on ``empty_cache()`` or when a ``cudaMalloc`` fails (then: release one
  oversize cached block if ``max_split_size`` is set, then every cached unsplit segment, and retry
  once; still failing is the out-of-memory error).

What it leaves out: streams and events (record_stream), CUDA graph private pools and MemPools,
``expandable_segments`` (off by default in every version checked, including recent main: it would
map 2/20 MiB pages into one growing segment instead), garbage_collection_threshold and memory
fractions, and the per-interval form of ``roundup_power2_divisions`` (one value for all sizes here).

``capacity`` stands for the memory ``cudaMalloc`` can take. On a discrete GPU ``cudaMalloc`` fails
cleanly there and the allocator releases its cache and retries (``retry_on_oom=True``, as the real
one). On a unified-memory machine (GB10) ``cudaMalloc`` keeps succeeding past what the system can
give and the process hangs instead: ``retry_on_oom=False`` makes crossing the capacity itself the
failure, which is what a pre-launch check must predict.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field

from alloc.units import fmt_bytes

# PyTorch's caching allocator's constants (kMinBlockSize ... kRoundLarge); the C core's copy of the
# segment sizes is in csrc/torch/plugin.c.
MIN_BLOCK_SIZE = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
SIZE_MAX = (1 << 64) - 1

# Fake device addresses only order blocks of equal size; segments start 2 MiB aligned like
# cudaMalloc's and far from 0 so a handle is never mistaken for "no allocation".
_FIRST_ADDRESS = 1 << 40


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """Rounds up to the next of ``divisions`` equal steps between two powers of two."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    base = size & ~(step - 1)
    return size if base == size else base + step


def round_size(size: int, roundup_power2_divisions: int = 0) -> int:
    """The block size the allocator looks for when asked for ``size`` bytes."""
    if size < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    if roundup_power2_divisions > 1 and size > MIN_BLOCK_SIZE * roundup_power2_divisions:
        return roundup_power2_next_division(size, roundup_power2_divisions)
    return -(-size // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE


def allocation_size(rounded: int) -> int:
    """The segment ``cudaMalloc`` is asked for when no cached block fits a rounded request."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


class ModelOutOfMemory(MemoryError):
    """The modelled allocator could not get a segment within its capacity."""

    chunk: int | None = None  # set by arena_tools.fit.replay: the workload chunk that failed

    def __init__(self, *, label: str, requested: int, segment: int, reserved: int, allocated: int,
                 capacity: int, retried: bool):
        self.label, self.requested, self.segment = label, requested, segment
        self.reserved, self.allocated, self.capacity = reserved, allocated, capacity
        what = f"{label}: " if label else ""
        after = "even after releasing every cached unsplit segment" if retried else (
            "and on unified memory cudaMalloc would not fail here: the process would hang")
        super().__init__(
            f"{what}default caching allocator out of memory: request of {fmt_bytes(requested)} "
            f"({requested} bytes) needs a new {fmt_bytes(segment)} segment, but it holds "
            f"{fmt_bytes(reserved)} ({fmt_bytes(allocated)} allocated) of a capacity of "
            f"{fmt_bytes(capacity)}, {after}")


@dataclass(eq=False)
class _Block:
    address: int
    size: int
    small: bool
    segment: int  # address of the segment's first byte
    allocated: bool = False
    prev: _Block | None = field(default=None, repr=False)
    next: _Block | None = field(default=None, repr=False)

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class CachingAllocatorModel:
    """PyTorch's caching allocator as bookkeeping only: no memory is touched.

    >>> m = CachingAllocatorModel()
    >>> m.free(m.malloc(10_649_600))  # the seed's first logits piece: a 12 MiB segment
    >>> m.free(m.malloc(20_480_000))  # the second does not fit it: 20 MiB more
    >>> m.reserved // 2**20, m.allocated, m.num_segments
    (32, 0, 2)
    """

    def __init__(self, capacity: int | None = None, *, retry_on_oom: bool = True,
                 max_split_size: int | None = None, max_non_split_rounding: int = LARGE_BUFFER,
                 roundup_power2_divisions: int = 0):
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be None or >= 0 bytes, got {capacity!r}")
        if max_split_size is not None and max_split_size < LARGE_BUFFER:
            raise ValueError(f"max_split_size must be >= {LARGE_BUFFER} bytes (20 MiB, as "
                             f"PyTorch requires), got {max_split_size!r}")
        if roundup_power2_divisions and roundup_power2_divisions & (roundup_power2_divisions - 1):
            raise ValueError("roundup_power2_divisions must be 0 or a power of two, got "
                             f"{roundup_power2_divisions!r}")
        self.capacity = capacity
        self.retry_on_oom = retry_on_oom
        self.max_split_size = SIZE_MAX if max_split_size is None else max_split_size
        self.max_non_split_rounding = max_non_split_rounding
        self.roundup_power2_divisions = roundup_power2_divisions
        # Free blocks per pool, sorted by (size, address): the order of the real std::set.
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self._blocks: dict[int, _Block] = {}  # every block, free or not, by address
        self._segments: dict[int, int] = {}  # segment address -> size
        self._next_address = _FIRST_ADDRESS
        self.reserved = self.allocated = 0
        self.peak = self.peak_allocated = self.peak_segments = 0
        self.num_device_alloc = self.num_device_free = 0
        self.num_alloc_retries = self.num_ooms = 0

    # -- public API -------------------------------------------------------------------------------
    @property
    def num_segments(self) -> int:
        return len(self._segments)

    def malloc(self, size: int, label: str = "") -> int:
        """Returns a handle (the block's fake address); 0 for a size of 0, as PyTorch does."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"size must be a non-negative int, got {size!r}")
        if size == 0:
            return 0
        rounded = round_size(size, self.roundup_power2_divisions)
        small = rounded <= SMALL_SIZE
        segment = allocation_size(rounded)
        block = self._take_free_block(small, rounded)
        if block is None:
            block = self._cuda_malloc(segment, small)
            retried = False
            if block is None and self.retry_on_oom:
                if self._release_available_cached_blocks(small, rounded):
                    block = self._cuda_malloc(segment, small)
                if block is None:
                    self._release_cached_blocks()
                    self.num_alloc_retries += 1
                    retried = True
                    block = self._cuda_malloc(segment, small)
            if block is None:
                self.num_ooms += 1
                raise ModelOutOfMemory(label=label, requested=size, segment=segment,
                                       reserved=self.reserved, allocated=self.allocated,
                                       capacity=self.capacity, retried=retried)
        if self._should_split(block, rounded):
            rest = _Block(block.address + rounded, block.size - rounded, small, block.segment,
                          prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = rounded
            self._blocks[rest.address] = rest
            insort(self._free[small], (rest.size, rest.address))
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block.address

    def free(self, handle: int) -> None:
        if handle == 0:
            return
        block = self._blocks.get(handle)
        if block is None or not block.allocated:
            raise ValueError(f"invalid device pointer: {handle:#x} is not an allocated block")
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._merge(block, neighbour)
        insort(self._free[block.small], (block.size, block.address))

    def empty_cache(self) -> int:
        """Releases every cached unsplit segment; returns the bytes given back."""
        before = self.reserved
        self._release_cached_blocks()
        return before - self.reserved

    def free_blocks(self) -> list[tuple[int, bool]]:
        """(size, small pool?) of every cached free block."""
        return [(size, small) for small in (True, False) for size, _ in self._free[small]]

    def check(self) -> None:
        """Raises AssertionError unless the blocks tile every segment and the counters agree."""
        allocated = 0
        for base, size in self._segments.items():
            block, end = self._blocks[base], base
            assert block.prev is None, f"segment {base:#x} starts mid-chain"
            while block is not None:
                assert block.address == end and block.segment == base, "blocks do not tile"
                if block.allocated:
                    allocated += block.size
                else:
                    assert (block.size, block.address) in self._free[block.small], "lost free block"
                    assert block.next is None or block.next.allocated, "unmerged free neighbours"
                end += block.size
                block = block.next
            assert end == base + size, f"segment {base:#x} blocks sum to {end - base}, not {size}"
        assert allocated == self.allocated, f"allocated {self.allocated} != blocks {allocated}"
        assert sum(self._segments.values()) == self.reserved, "reserved != sum of segments"
        assert all(b.segment in self._segments for b in self._blocks.values()), "orphan block"
        assert sum(map(len, self._free.values())) == sum(
            1 for b in self._blocks.values() if not b.allocated), "free lists out of step"

    # -- the real allocator's steps ---------------------------------------------------------------
    def _take_free_block(self, small: bool, rounded: int) -> _Block | None:
        """get_free_block: best fit, with the oversize rules."""
        pool = self._free[small]
        i = bisect_left(pool, (rounded, 0))
        if i == len(pool):
            return None
        size, address = pool[i]
        if rounded < self.max_split_size <= size:
            return None  # an oversize block is kept for oversize requests
        if rounded >= self.max_split_size and size >= rounded + self.max_non_split_rounding:
            return None  # it would waste too much of an unsplittable block
        del pool[i]
        return self._blocks[address]

    def _should_split(self, block: _Block, rounded: int) -> bool:
        remaining = block.size - rounded
        if block.small:
            return remaining >= MIN_BLOCK_SIZE
        return rounded < self.max_split_size and remaining > SMALL_SIZE

    def _cuda_malloc(self, size: int, small: bool) -> _Block | None:
        if self.capacity is not None and self.reserved + size > self.capacity:
            return None
        address = self._next_address
        self._next_address += -(-size // ROUND_LARGE) * ROUND_LARGE
        block = _Block(address, size, small, address)
        self._blocks[address] = block
        self._segments[address] = size
        self.reserved += size
        self.num_device_alloc += 1
        self.peak = max(self.peak, self.reserved)
        self.peak_segments = max(self.peak_segments, len(self._segments))
        return block

    def _release(self, block: _Block) -> None:
        assert not block.allocated and not block.is_split
        self._free[block.small].remove((block.size, block.address))
        del self._blocks[block.address]
        del self._segments[block.address]
        self.reserved -= block.size
        self.num_device_free += 1

    def _release_cached_blocks(self) -> None:
        for small in (False, True):
            for size, address in list(self._free[small]):
                block = self._blocks[address]
                if not block.is_split:
                    self._release(block)

    def _release_available_cached_blocks(self, small: bool, rounded: int) -> bool:
        """Frees oversize cached segments (only with max_split_size set) until one could fit."""
        if self.max_split_size == SIZE_MAX:
            return False
        pool = self._free[small]
        key = max(rounded, self.max_split_size)
        i = bisect_left(pool, (key, 0))
        if i < len(pool):
            self._release(self._blocks[pool[i][1]])
            return True
        released = 0
        for size, address in reversed(list(pool)):
            if released >= key or size < self.max_split_size:
                break
            self._release(self._blocks[address])
            released += size
        return released >= key

    def _merge(self, block: _Block, neighbour: _Block) -> None:
        self._free[neighbour.small].remove((neighbour.size, neighbour.address))
        del self._blocks[neighbour.address]
        if neighbour is block.prev:
            del self._blocks[block.address]
            block.address = neighbour.address
            block.prev = neighbour.prev
            if block.prev is not None:
                block.prev.next = block
            self._blocks[block.address] = block
        else:
            block.next = neighbour.next
            if block.next is not None:
                block.next.prev = block
        block.size += neighbour.size
