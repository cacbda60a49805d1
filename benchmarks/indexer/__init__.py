"""The indexer's benchmarks: the kernels against their ceilings and torch, the chunked prefill."""
