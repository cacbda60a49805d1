"""The allocator's benchmarks: the C core, the arena as PyTorch's allocator, two ranks."""
