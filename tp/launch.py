"""Starts tensor-parallel ranks with the chosen CUDA allocator installed before CUDA starts.

Two ways to start the same ranks::

    python -m tp.launch --nproc-per-node 2 --allocator arena SCRIPT [ARGS...]
    torchrun --nproc-per-node 2 -m tp.launch --allocator arena SCRIPT [ARGS...]

A process that finds ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` in its environment is a rank
(torchrun sets them, and so does this launcher for its children); one that does not is the
launcher, which starts ``--nproc-per-node`` copies of itself with those variables plus
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, waits for them, and stops the rest
when one fails. A rank runs ``init_rank`` and then SCRIPT (or, with ``-m``, a module) as
``__main__``; the script finds its ``RankContext`` with ``context()``.

``init_rank`` does, in this order: forces NVLink multicast off (NCCL NVLS, symmetric-memory
multicast, NVSHMEM NVLS), installs the arena (``--allocator arena``; PyTorch cannot change its
allocator once CUDA is initialised, so this comes before anything touches CUDA), selects the
rank's GPU, reserves the arena's workspace budget, initialises the process group eagerly (NCCL on
a GPU, gloo on the CPU) and runs one collective. It records the device memory and the allocator's
reservation between those steps, so that NCCL's own memory (what the communicator takes
outside the PyTorch allocator) can be told apart from the tensors it allocates through it.

Allocators: ``arena`` (this project's, installed), ``default`` (PyTorch's caching allocator,
nothing installed) and ``none``: the ranks run on the CPU with gloo, and no CUDA allocator is
involved at all. ``arena`` and ``default`` need CUDA and say so when it is missing; nothing is
skipped silently.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta

from arena_tools.allocators import ALLOCATORS as TABLE
from arena_tools.allocators import install as install_allocator

__all__ = ["ALLOCATORS", "MULTICAST_OFF", "LaunchError", "RankEnv", "MemoryMark", "RankContext",
           "context", "init_rank", "spawn", "main"]

# Of the allocators compared (arena_tools.allocators) the ranks take the arena or PyTorch's as it
# ships, whatever PYTORCH_CUDA_ALLOC_CONF the caller set; "none" runs them on the CPU.
ALLOCATORS = (*(TABLE[name].name for name in ("arena", "default")), "none")

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
"""NVLink multicast stays off on the machines this runs on; NCCL, torch's symmetric memory and
NVSHMEM read these when their first communicator is made, so setting them in the rank before
``init_process_group`` is early enough."""

REGISTER_HOOK_VAR = "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"
"""With this on, ProcessGroupNCCL attaches a trace tracker to the CUDA allocator to register
every segment with NCCL; ``CUDAPluggableAllocator.attachAllocatorTraceTracker`` raises, so under
the arena it must stay off (it is off by default)."""

_TRUE = ("1", "true", "yes", "on", "y")


class LaunchError(RuntimeError):
    """The ranks cannot be started as asked; the message says what to change."""


@dataclass(frozen=True)
class RankEnv:
    """The torchrun environment of one rank."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls, environ=None) -> RankEnv | None:
        """None when the process is not a rank (no RANK, WORLD_SIZE, LOCAL_RANK); raises when
        only some of them are set, or MASTER_ADDR/MASTER_PORT are missing."""
        environ = os.environ if environ is None else environ
        core = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
        present = [v for v in core if v in environ]
        if not present:
            return None
        missing = [v for v in (*core, "MASTER_ADDR", "MASTER_PORT") if v not in environ]
        if missing:
            raise LaunchError(f"{', '.join(present)} set but {', '.join(missing)} missing: start "
                              "the ranks with python -m tp.launch or torchrun")
        try:
            env = cls(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["LOCAL_RANK"]),
                      int(environ.get("LOCAL_WORLD_SIZE", environ["WORLD_SIZE"])),
                      environ["MASTER_ADDR"], int(environ["MASTER_PORT"]))
        except ValueError as e:
            raise LaunchError(f"malformed rank environment: {e}") from None
        if not (0 <= env.rank < env.world_size and 0 <= env.local_rank < env.local_world_size):
            raise LaunchError(f"inconsistent rank environment: {env}")
        return env


@dataclass
class MemoryMark:
    """Device memory at one point of a rank's life. ``device_used`` is total minus free from
    cudaMemGetInfo (the whole device, every process on it); ``allocator_reserved`` is what the
    PyTorch allocator in use holds. Both are None on the CPU."""
    label: str
    time_s: float
    device_used: int | None
    allocator_reserved: int | None


@dataclass
class RankContext:
    env: RankEnv
    allocator: str
    backend: str
    device: object  # torch.device
    alloc_conf: str  # PYTORCH_CUDA_ALLOC_CONF as the rank saw it
    marks: list[MemoryMark] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def allocator_reserved(self) -> int | None:
        if self.allocator == "arena":
            import alloc
            return alloc.memory_reserved(self.device.index)
        if self.allocator == "default":
            import torch
            return torch.cuda.memory_reserved(self.device)
        return None

    def device_used(self) -> int | None:
        if not self.cuda:
            return None
        import torch
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def mark(self, label: str) -> MemoryMark:
        """Records the memory now, after the device's queued work is done."""
        if self.cuda:
            import torch
            torch.cuda.synchronize(self.device)
        m = MemoryMark(label, time.perf_counter(), self.device_used(), self.allocator_reserved())
        self.marks.append(m)
        return m

    def find(self, label: str) -> MemoryMark:
        return next(m for m in self.marks if m.label == label)

    def cost(self, before: str, after: str) -> dict:
        """Device memory taken between two marks, split into what the PyTorch allocator
        reserved and what was allocated around it (NCCL's cudaMalloc/cuMem buffers, context
        state): ``outside = device - allocator``."""
        a, b = self.find(before), self.find(after)
        if a.device_used is None:
            return {"device": None, "allocator": None, "outside": None}
        device = b.device_used - a.device_used
        allocator = (b.allocator_reserved or 0) - (a.allocator_reserved or 0)
        return {"device": device, "allocator": allocator, "outside": device - allocator}

    def to_dict(self) -> dict:
        watched = (*MULTICAST_OFF, REGISTER_HOOK_VAR, "TORCH_NCCL_AVOID_RECORD_STREAMS")
        out = {"env": asdict(self.env), "allocator": self.allocator, "backend": self.backend,
               "device": str(self.device), "alloc_conf": self.alloc_conf,
               "settings": {k: os.environ.get(k) for k in watched},
               "marks": [asdict(m) for m in self.marks]}
        if len(self.marks) >= 2 and any(m.label == "first collective" for m in self.marks):
            out["process_group_cost"] = self.cost("before process group", "first collective")
        return out


_context: RankContext | None = None


def context() -> RankContext | None:
    """This rank's context, once ``init_rank`` has run in the process."""
    return _context


def _no_cuda_message(allocator: str) -> str:
    return (f"--allocator {allocator} needs CUDA, and torch sees no CUDA device here. On the CPU "
            "pass --allocator none: the ranks then run on the CPU with the gloo backend and no "
            "CUDA allocator (neither the arena nor PyTorch's) is used")


def _check_allocator(allocator: str, nproc: int | None = None) -> None:
    if allocator not in ALLOCATORS:
        raise LaunchError(f"unknown allocator {allocator!r}; accepted: {', '.join(ALLOCATORS)}")
    if allocator == "none":
        return
    import torch
    if not torch.cuda.is_available():
        raise LaunchError(_no_cuda_message(allocator))
    count = torch.cuda.device_count()
    if nproc is not None and nproc > count:
        raise LaunchError(f"{nproc} ranks per node asked, and torch sees {count} CUDA device(s): "
                          "each rank needs its own GPU")


def _default_backend(allocator: str) -> str:
    return "gloo" if allocator == "none" else "nccl"


def _force_multicast_off(environ) -> None:
    for name, value in MULTICAST_OFF.items():
        if environ.get(name, value) != value:
            print(f"tp.launch: {name}={environ[name]} overridden with {value}: NVLink multicast "
                  "stays off", file=sys.stderr)
        environ[name] = value


def init_rank(allocator: str = "arena", backend: str | None = None, *,
              timeout_s: float = 600.0) -> RankContext:
    """Makes this process the rank its environment names; see the module docstring for the
    order of the steps. A second call with the same choice returns the same context."""
    global _context
    backend = backend or _default_backend(allocator)
    if _context is not None:
        if (_context.allocator, _context.backend) != (allocator, backend):
            raise LaunchError(f"this rank was started with --allocator {_context.allocator} "
                              f"(backend {_context.backend}); it cannot switch to {allocator} "
                              f"({backend})")
        return _context
    env = RankEnv.from_environ()
    if env is None:
        raise LaunchError("this process is not a rank (RANK, WORLD_SIZE, LOCAL_RANK are not "
                          "set): start it with python -m tp.launch or torchrun")
    if backend not in ("nccl", "gloo"):
        raise LaunchError(f"unknown backend {backend!r}; accepted: nccl, gloo")
    if allocator == "none" and backend == "nccl":
        raise LaunchError("--allocator none runs the ranks on the CPU, where NCCL cannot; use "
                          "the gloo backend, or a CUDA allocator for NCCL")
    if allocator != "none" and backend == "gloo":
        raise LaunchError(f"--allocator {allocator} puts the ranks on GPUs, whose collectives "
                          "this project runs through NCCL; gloo is for --allocator none")
    _force_multicast_off(os.environ)
    if allocator == "arena" and os.environ.get(REGISTER_HOOK_VAR, "0").lower() in _TRUE:
        raise LaunchError(f"{REGISTER_HOOK_VAR} is on: ProcessGroupNCCL would attach a trace "
                          "tracker to the CUDA allocator, which CUDAPluggableAllocator refuses; "
                          f"unset it (or set it to 0) to run under the arena")
    _check_allocator(allocator, None)
    import torch
    import torch.distributed as dist
    if allocator != "none":
        install_allocator(allocator)  # raises InstallError if CUDA was initialised before this point
    if allocator != "none":
        if env.local_rank >= torch.cuda.device_count():
            raise LaunchError(f"local rank {env.local_rank} has no GPU: torch sees "
                              f"{torch.cuda.device_count()}")
        device = torch.device("cuda", env.local_rank)
        # Selected before any allocation so that this rank makes its context on its own GPU
        # only; a stray context on GPU 0 would show in rank 0's memory.
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    ctx = RankContext(env, allocator, backend, device,
                      os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    ctx.mark("context")
    if allocator == "arena":
        import alloc
        alloc.reserve(env.local_rank)
        ctx.mark("workspace reserved")
    ctx.mark("before process group")
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    # device_id makes ProcessGroupNCCL create its communicator now instead of at the first
    # collective, so the two costs can be read apart.
    dist.init_process_group(backend, init_method="env://", rank=env.rank,
                            world_size=env.world_size, timeout=timedelta(seconds=timeout_s),
                            **kwargs)
    ctx.mark("process group")
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    if probe.item() != env.world_size:
        raise LaunchError(f"the first all-reduce summed to {probe.item()}, not {env.world_size}")
    del probe
    ctx.mark("first collective")
    _check_ranks_agree(allocator, env, device)
    _context = ctx
    return ctx


def rank_settings(allocator: str, environ=None) -> str:
    """What every rank of one launch must share: the allocator, and the workspace budget and
    alignment the indexer plans its chunks from (INDEXER_ARENA_CONF, as the arena reads it)."""
    from alloc import config as config_mod
    from alloc.engine_settings import planning
    from alloc.errors import ConfigError
    try:
        config = config_mod.from_env(os.environ if environ is None else environ)
    except ConfigError as e:
        raise LaunchError(str(e)) from None
    return f"allocator {allocator}, {planning(config)}"


def _check_ranks_agree(allocator: str, env: RankEnv, device) -> None:
    """Every rank's settings gathered over the new group: ranks started with another
    INDEXER_ARENA_CONF (another node's environment) are named now, on every rank alike, instead
    of planning different chunks and hanging in a later collective."""
    import torch.distributed as dist

    from alloc.engine_settings import disagreement
    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, rank_settings(allocator))
    bad = disagreement(gathered)
    if bad:
        # Closed now: a group's threads left running abort the interpreter's exit.
        dist.destroy_process_group()
        raise LaunchError(f"rank {env.rank} of {env.world_size}: {bad}")


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_environ(base, env: RankEnv, allocator: str, nproc: int) -> dict:
    """The environment of one spawned rank."""
    out = dict(base)
    out.update({"RANK": str(env.rank), "WORLD_SIZE": str(env.world_size),
                "LOCAL_RANK": str(env.local_rank), "LOCAL_WORLD_SIZE": str(env.local_world_size),
                "MASTER_ADDR": env.master_addr, "MASTER_PORT": str(env.master_port)})
    out.update(MULTICAST_OFF)
    if allocator == "arena":
        out[REGISTER_HOOK_VAR] = "0"
    # The children import tp from the tree this launcher came from, whatever their cwd.
    root = _package_root()
    paths = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        out["PYTHONPATH"] = os.pathsep.join([root, *paths])
    if "OMP_NUM_THREADS" not in out:
        # Ranks share the host's cores; torchrun sets 1, which starves the CPU-side checks.
        out["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    return out


def spawn(nproc: int, target: list[str], *, allocator: str, backend: str | None = None,
          master_addr: str = "127.0.0.1", master_port: int = 0, environ=None,
          poll_s: float = 0.1, grace_s: float = 10.0) -> int:
    """Starts ``nproc`` ranks running ``python -m tp.launch --allocator A [--backend B] TARGET``
    and waits for them. If one fails, the others are terminated (then killed after ``grace_s``)
    and its exit status is returned; 0 when all succeed."""
    if nproc < 1:
        raise LaunchError(f"--nproc-per-node must be at least 1, got {nproc}")
    _check_allocator(allocator, nproc)
    if allocator == "arena":
        # Built once here rather than by every rank at install() time.
        from alloc import shims
        shims.build("oom")
        shims.build("allocator")
    port = master_port or _free_port(master_addr)
    base = os.environ if environ is None else environ
    opts = ["--allocator", allocator] + (["--backend", backend] if backend else [])
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(nproc):
            env = RankEnv(rank, nproc, rank, nproc, master_addr, port)
            procs.append(subprocess.Popen([sys.executable, "-m", "tp.launch", *opts, *target],
                                          env=child_environ(base, env, allocator, nproc)))
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(f"tp.launch: rank {rank} exited with status {code}; stopping the others",
                      file=sys.stderr)
                _stop(procs, grace_s)
                return code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)
    except BaseException:
        _stop(procs, grace_s)
        raise


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _run_target(module: bool, target: str, args: list[str]) -> int:
    """Runs the rank's program as __main__; its exit status (a script ending in
    ``sys.exit(main())`` raises SystemExit even when it succeeds)."""
    sys.argv = [target, *args]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            # As `python SCRIPT` would: the script's directory first on the path.
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        if e.code is None or e.code == 0:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tp.launch",
        description="Start tensor-parallel ranks with a CUDA allocator installed before CUDA "
                    "starts (torchrun-compatible: under torchrun each process is one rank).")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1,
                   help="ranks to start (ignored in a rank: torchrun decides there)")
    p.add_argument("--allocator", choices=ALLOCATORS, default="arena",
                   help="arena: this project's, installed in each rank before CUDA starts; "
                        "default: PyTorch's caching allocator; none: CPU ranks on gloo")
    p.add_argument("--backend", choices=("nccl", "gloo"),
                   help="process group backend (default: nccl on GPUs, gloo for none)")
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", type=int, default=0,
                   help="0: a free port")
    p.add_argument("-m", "--module", action="store_true",
                   help="TARGET is a module to run as __main__, as python -m")
    p.add_argument("target", help="the script (or module with -m) each rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        env = RankEnv.from_environ()
        if env is None:
            target = (["-m"] if args.module else []) + [args.target, *args.args]
            return spawn(args.nproc_per_node, target, allocator=args.allocator,
                         backend=args.backend, master_addr=args.master_addr,
                         master_port=args.master_port)
        init_rank(args.allocator, args.backend)
    except LaunchError as e:
        print(f"tp.launch: {e}", file=sys.stderr)
        return 2
    code = _run_target(args.module, args.target, args.args)
    import torch.distributed as dist
    if dist.is_initialized():
        # Only after the program returned: one that raised leaves its peers mid-collective, and
        # the launcher stops them instead of waiting on a teardown that cannot finish.
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    # Run as `python -m tp.launch`, this file is __main__, a second copy of the module; the
    # script looks for its context in tp.launch, so the real module must be the one that runs.
    from tp import launch as _launch
    sys.exit(_launch.main())
