"""Tensor parallelism around the indexer, on torch.distributed.

``tp.launch`` starts the ranks (its own launcher or torchrun) and installs the allocator in each
before CUDA starts; ``tp.mlp`` is the sharded MLP closed by an all-reduce; ``tp.step`` is the
per-chunk serving step around the replicated indexer prefill. The submodules are imported on
demand: the launcher must run before anything here imports torch's CUDA side or Triton.

How NCCL's memory and the arena live together, per rank:

- NCCL allocates its own device memory (communicator state, one buffer per channel, peer and
  protocol, made when a connection is first used) with cudaMalloc / cuMem directly. No PyTorch
  allocator sees it: it is outside the arena's budget and statistics, as it is outside
  ``torch.cuda.memory_reserved()`` under PyTorch's allocator. On a unified-memory device the arena's
  guard sees it only through MemAvailable. ``RankContext.cost`` reads it as device memory taken
  (cudaMemGetInfo) minus what the allocator reserved over the same steps; benchmarks/alloc/tp_seed.py
  reports it for process-group init plus the first collective, and for the first full-size
  all-reduce.
- ProcessGroupNCCL's tensors (collective inputs and outputs, ``all_gather_object`` buffers) are
  ordinary CUDA tensors: they come from the arena's general pools, never from its workspace, and
  ``record_stream`` on them is honoured.
- ``TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK`` must stay off under the arena (the hook needs
  ``attachAllocatorTraceTracker``, which ``CUDAPluggableAllocator`` refuses); the launcher sets
  it to 0 and ``init_rank`` refuses it on. NVLink multicast (NCCL NVLS, symmetric-memory
  multicast, NVSHMEM NVLS) is forced off in every rank.
"""

__all__ = ["launch", "mlp", "step"]
