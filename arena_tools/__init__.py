"""indexer-arena's offline tools: reports, traces in other tools' formats, replay under several
allocators, the pre-launch fit check, and the allocator table the benchmarks share.

They import the runtime (``alloc``), never the other way round; ``python -m arena_tools`` is
their command line. Their extra dependencies (rich, matplotlib) come with ``pip install
indexer-arena[tools]``.
"""
