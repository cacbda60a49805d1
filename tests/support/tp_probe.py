"""One rank of tests/tp/test_launch.py: reports what the rank was given and checks the sharded MLP.

Run by ``python -m tp.launch`` or ``torchrun -m tp.launch`` with ``--allocator none``; writes
``OUT_DIR/rank<R>.json``. Argument: OUT_DIR, then any extra arguments (echoed back, to show that
they reach the script untouched).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import tp.launch
from tp.mlp import ShardedMLP, full_weights, reference_mlp

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
            "OMP_NUM_THREADS")
HIDDEN, INTERMEDIATE, TOKENS, SEED = 24, 40, 7, 3


def mlp_errors(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    gate_up, down = full_weights(SEED, HIDDEN, INTERMEDIATE)
    want = reference_mlp(x, gate_up, down)
    out = {}
    for name, dtype in (("float64", torch.float64), ("float32", torch.float32)):
        mlp = ShardedMLP.from_seed(SEED, HIDDEN, INTERMEDIATE, rank, world, dtype=dtype,
                                   device="cpu")
        partial = mlp.partial(x.to(dtype))
        got = mlp(x.to(dtype))
        out[name] = {
            "rel_err": ((got.double() - want).norm() / want.norm()).item(),
            # A rank's own summand is not the answer unless it is the only rank.
            "partial_rel_err": ((partial.double() - want).norm() / want.norm()).item(),
            "digest": got.double().sum().item(),
        }
    return out


def main() -> None:
    out_dir = Path(sys.argv[1])
    ctx = tp.launch.context()
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    gathered = [None] * world
    dist.all_gather_object(gathered, os.getpid())
    report = {
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
        "argv": sys.argv[1:],
        "context": None if ctx is None else ctx.to_dict(),
        "backend": dist.get_backend(),
        "rank": rank, "world_size": world,
        "sum_of_ranks_plus_one": total.item(),
        "pids": gathered,
        "cuda_initialized": torch.cuda.is_initialized(),
        "mlp": mlp_errors(rank, world),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
