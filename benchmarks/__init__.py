"""The benchmarks: alloc/ (the allocator), indexer/ (the kernels and the prefill), harness.py
(what they share). Programs, run by path; RESULTS.md records their figures."""
