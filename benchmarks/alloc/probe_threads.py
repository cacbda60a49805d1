"""Where a ``torch.empty`` + ``del`` pair spends its time on this host, under whatever allocator
the process has (nothing installed: PyTorch's): from the main thread with the device as a string
and as a ``torch.device``, from a started Python thread, and a CPU tensor for scale; 100,000 pairs
of 4 KiB each, twice.

    python benchmarks/alloc/probe_threads.py
"""
import os
import sys
import threading
import time

import torch

dev = torch.device("cuda", 0)
torch.empty(1, device="cuda")
N = 100_000


def loop(device, size=4096):
    t0 = time.perf_counter()
    for _ in range(N):
        t = torch.empty(size, dtype=torch.uint8, device=device)
        del t
    return (time.perf_counter() - t0) / N * 1e6


def in_thread(fn):
    out = []
    th = threading.Thread(target=lambda: out.append(fn()))
    th.start()
    th.join()
    return out[0]


for rep in range(2):
    print(f"rep {rep}: main 'cuda' {loop('cuda'):.2f} us, main device obj {loop(dev):.2f} us, "
          f"thread 'cuda' {in_thread(lambda: loop('cuda')):.2f} us, cpu tensor {loop('cpu'):.2f} us", flush=True)
print("switchinterval", sys.getswitchinterval(), "torch", torch.__version__)
print("cpus", os.cpu_count(), "loadavg", os.getloadavg())
