"""What the GPU tests of the allocator share: a child interpreter that prints one JSON line, a
piece of ordinary work whose results must not depend on the allocator, the tensors whose device
cost the pools must match, and a simulated unified machine's meminfo file."""

import json

from tests.support import run_python

PRELUDE = """
import contextlib, json, os, threading, time
import torch
import alloc
"""


def run(body: str, env: dict | None = None, timeout: float = 300) -> dict:
    done = run_python(PRELUDE + body, env=env, timeout=timeout)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


ORDINARY_WORK = """
g = torch.Generator(device="cuda").manual_seed(1234)
x = torch.randn(1537, 769, device="cuda", generator=g)
w = torch.randn(769, 1025, device="cuda", generator=g)
conv = torch.nn.Conv2d(3, 17, 5).cuda()
torch.manual_seed(0); conv.reset_parameters()
img = torch.randn(4, 3, 67, 61, device="cuda", generator=g)
outs = {
  "matmul": (x @ w).double().sum().item(),
  "softmax": torch.softmax(x, 1).double().sum().item(),
  "cumsum": torch.cumsum(x, 0)[-1].double().sum().item(),
  "conv": conv(img).double().sum().item(),
  "sort": torch.sort(x.flatten())[0][::997].double().sum().item(),
  "cat": torch.cat([x[:100], x[-100:]]).double().sum().item(),
}
"""


# After the pools' first allocation: free0 and held0, then 180 MiB of large tensors (3 and 12 MiB)
# and 20 MiB of small ones kept live as ts and small, then the statistics as s. What the device
# paid (free0 less what is free now) must match what the pools hold (the reserved bytes' growth).
DEVICE_COST_WORK = """\
torch.empty(1, device="cuda")
torch.cuda.synchronize()
free0, held0 = torch.cuda.mem_get_info()[0], alloc.memory_reserved()
ts = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in [3] * 12 + [12] * 6]
small = [torch.empty(1 << 19, dtype=torch.uint8, device="cuda") for _ in range(40)]
torch.cuda.synchronize()
s = alloc.memory_stats()
"""

def simulated_meminfo(path, available: str) -> str:
    """Child code defining update(), which rewrites the meminfo file at `path` (atomically) with
    `available` bytes, a Python expression, less what the process has taken from the device since
    free0 was read, as MemAvailable falls on a unified machine; install with meminfo=path."""
    return f"""
path = {str(path)!r}
def update():
    taken = free0 - torch.cuda.mem_get_info()[0]
    with open(path + ".tmp", "w") as f:
        f.write(f"MemTotal: {{128 << 20}} kB\\nMemAvailable: {{(({available}) - taken) >> 10}} kB\\n")
    os.replace(path + ".tmp", path)
"""
