"""Tensor parallelism around the indexer, on torch.distributed.

``tp.launch`` starts the ranks (its own launcher or torchrun) and installs the allocator in each
before CUDA starts; ``tp.mlp`` is the sharded MLP closed by an all-reduce; ``tp.step`` is the
per-chunk serving step around the replicated indexer prefill. The submodules are imported on
demand: the launcher must run before anything here imports torch's CUDA side or Triton.
"""

__all__ = ["launch", "mlp", "step"]
