"""A tensor-parallel MLP: column-parallel gate/up, SwiGLU, row-parallel down, one all-reduce.

The layout is Megatron's, as vLLM serves it (``MergedColumnParallelLinear`` then
``RowParallelLinear``): with ``tp`` ranks and intermediate size ``I``, rank ``r`` holds the
gate and up columns ``[r*I/tp, (r+1)*I/tp)`` of ``gate_up`` ``[hidden, 2*I]`` and the same rows of
``down`` ``[I, hidden]``. ``silu(x @ gate) * (x @ up)`` needs no communication because each rank
owns whole intermediate features; ``h_r @ down_r`` is a partial sum over the rank's features, and
one all-reduce (sum) over the group completes it. Every rank ends with the same full output.

Weights are ``x @ W`` matrices (``[in, out]``). Each intermediate feature has its own seeded
generator, so a rank can build its shard without the rest and the shards of any ``tp``
concatenate to the same full weight: the unsharded reference regenerates the full matrices from
the seed instead of trusting the shards it is meant to check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["ShardedMLP", "shard_range", "gate_up_columns", "down_rows", "full_weights",
           "reference_mlp"]

_GATE_UP, _DOWN = 1, 2
_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9)


def shard_range(size: int, rank: int, world_size: int) -> range:
    """The contiguous block of ``size`` features that ``rank`` owns. The size must divide
    evenly: uneven shards would make ranks wait on the largest one, and no served model has
    them."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of {world_size}")
    if size % world_size:
        raise ValueError(f"{size} features do not split evenly over {world_size} ranks")
    per = size // world_size
    return range(rank * per, (rank + 1) * per)


def _feature_seed(seed: int, tensor: int, feature: int) -> int:
    return (seed * _MIX[0] + tensor * _MIX[1] + feature) % (1 << 63)


def _seeded_vectors(seed: int, tensor: int, features: Sequence[int], length: int,
                    scale: float) -> torch.Tensor:
    """float32 ``[len(features), length]`` on the CPU, row i drawn from feature i's generator."""
    out = torch.empty(len(features), length, dtype=torch.float32)
    g = torch.Generator()
    for i, f in enumerate(features):
        g.manual_seed(_feature_seed(seed, tensor, f))
        torch.randn(length, generator=g, out=out[i])
    return out.mul_(scale)


def gate_up_columns(seed: int, hidden: int, intermediate: int, features: Sequence[int]
                    ) -> torch.Tensor:
    """float32 ``[hidden, 2 * len(features)]``: the gate columns of ``features``, then their up
    columns (the merged column-parallel layout)."""
    gate = _seeded_vectors(seed, _GATE_UP, features, hidden, hidden ** -0.5)
    up = _seeded_vectors(seed, _GATE_UP, [intermediate + f for f in features], hidden,
                         hidden ** -0.5)
    return torch.cat([gate, up]).t().contiguous()


def down_rows(seed: int, hidden: int, intermediate: int, features: Sequence[int]) -> torch.Tensor:
    """float32 ``[len(features), hidden]``: the rows of ``down`` for ``features``."""
    return _seeded_vectors(seed, _DOWN, features, hidden, intermediate ** -0.5)


def full_weights(seed: int, hidden: int, intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded float32 ``gate_up`` ``[hidden, 2I]`` and ``down`` ``[I, hidden]``."""
    every = range(intermediate)
    return (gate_up_columns(seed, hidden, intermediate, every),
            down_rows(seed, hidden, intermediate, every))


def reference_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The unsharded MLP in float64: ``silu(x @ gate) * (x @ up) @ down``."""
    x, gate_up, down = x.double(), gate_up.double(), down.double()
    gate, up = (x @ gate_up).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down


@dataclass
class ShardedMLP:
    """One rank's shard. ``gate_up`` ``[hidden, 2 * I/tp]`` (gate columns, then up columns),
    ``down`` ``[I/tp, hidden]``; ``group`` is the tensor-parallel process group (None: the
    default group)."""
    gate_up: torch.Tensor
    down: torch.Tensor
    group: object = None

    @classmethod
    def from_seed(cls, seed: int, hidden: int, intermediate: int, rank: int, world_size: int, *,
                  dtype: torch.dtype, device: torch.device | str, group=None) -> ShardedMLP:
        """The shard of the seeded weights that ``rank`` of ``world_size`` owns, generated on
        the CPU in float32 and then cast, so every rank and the reference see the same values."""
        mine = shard_range(intermediate, rank, world_size)
        gate_up = gate_up_columns(seed, hidden, intermediate, mine).to(device=device, dtype=dtype)
        down = down_rows(seed, hidden, intermediate, mine).to(device=device, dtype=dtype)
        return cls(gate_up, down, group)

    @property
    def nbytes(self) -> int:
        return self.gate_up.numel() * self.gate_up.element_size() + \
            self.down.numel() * self.down.element_size()

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's summand of the output: its intermediate features only."""
        gate, up = (x @ self.gate_up).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.down

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        out = self.partial(x)
        # Called even with one rank, so that a world-size-1 run goes through the same NCCL path
        # (and pays for the same communicator) as the sharded one.
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out
