#!/usr/bin/env python
"""Benchmark of the indexer's prefill path on one GPU (written for an H200).

    python benchmarks/indexer/bench_indexer.py --json results.json

Prints one table and writes it as JSON:

- ceilings measured in this run: bf16 ``torch.matmul`` and fp8 ``torch._scaled_mm`` (fast
  accumulation, like the kernel's), 8192^3;
- logits kernel TFLOP/s at M=4096, N=65536, H=64, D=128 (2*M*N*H*D counting only pairs inside
  [ks, ke)), bf16 and fp8, full rows and causal rows (row i sees the first (i+1)*N/M keys: the
  queries of a prefill spread over the kv, half the pairs), beside the ceiling and the float32
  torch reference; goals: bf16 >= 95% of matmul, fp8 >= 90% of _scaled_mm, causal >= 1.8x
  faster than full. Each dtype's cases and its ceiling are timed in turn over five rounds;
  a fraction of the ceiling is the median of the rounds' fractions;
- top-k of 2048 per row over [4096, 65536] float32 logits against torch.topk (goal >= 4x,
  identical sets);
- one indexer layer's chunked prefill of a 254,000-token prompt in 3,200-token chunks (fp8,
  compress ratio 4, logits budget 512 MiB): wall time; logits and top-k device time (CUDA
  events); "everything else" = wall minus the same kernels replayed alone back to back (goal:
  < 5%); the host time a prefill call takes; pieces and device memory — with PyTorch's caching
  allocator here, and, when the alloc extension is built, again in a child process with the
  arena installed.

Before the table, a sweep times the candidate tile configs of both kernels at the benchmark
shape; the table uses the fastest (``--no-sweep``: the built-in defaults). All timings are
``triton.testing.do_bench`` medians on fresh random data.

``--smoke`` runs every section at toy sizes on the CPU under the Triton interpreter, to check
the script itself without a GPU (its numbers mean nothing).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from alloc.units import MiB  # noqa: E402
from arena_tools import allocators  # noqa: E402  (neither imports torch: --smoke and --arena come first)
from benchmarks import harness  # noqa: E402


def parse_args(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--only", default="ceilings,sweep,logits,topk,prefill",
                   help="comma-separated sections to run (default: all)")
    p.add_argument("--no-sweep", action="store_true", help="skip the config sweep")
    p.add_argument("--no-arena-run", action="store_true",
                   help="do not re-run the prefill with the arena installed")
    p.add_argument("--prefill-rounds", type=int, default=2,
                   help="prefill passes of each allocator, alternated: this process (PyTorch's "
                   "allocator), then a fresh process with the arena installed (default 2)")
    p.add_argument("--arena", action="store_true",
                   help="install the alloc arena first (used by the child run)")
    p.add_argument("--logits-config", help="fp8 H=64 D=128 logits config: BLOCK_M,BLOCK_N,"
                   "warps,stages (portable kernel) or wgmma:stages,consumers,linear_terms (sm_90 kernel)")
    p.add_argument("--topk-config", help="top-k config as comma-separated field=value pairs of "
                   "TopkConfig (block, collect_block, cand, chunk, runs, run, z, stages, "
                   "num_warps, programs_per_sm, sampled, stream, segment); fields left out keep the "
                   "default for k (stream=True: the streaming layout)")
    p.add_argument("--prompt", type=int, default=254_000)
    p.add_argument("--chunk", type=int, default=3_200)
    p.add_argument("--budget-mb", type=int, default=512)
    p.add_argument("--smoke", action="store_true",
                   help="toy sizes on the CPU (Triton interpreter); checks the script only")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"     # before triton is imported
if ARGS is not None and ARGS.arena:
    import alloc                              # the arena must be PyTorch's allocator before CUDA
    alloc.install(alloc.Config(budget_mb=ARGS.budget_mb))

import torch  # noqa: E402
import triton  # noqa: E402

import indexer  # noqa: E402
from indexer import DenseKV, PrefillStats, prefill_topk, row_stride_elems  # noqa: E402
from indexer import logits as logits_mod  # noqa: E402
from indexer import reference as ref  # noqa: E402
from indexer import topk as topk_mod  # noqa: E402
from benchmarks.indexer.cases import (FP8, alloc_importable, causal_ends, dtype_name,  # noqa: E402
                                      logits_config_text, memory, parse_logits_config,
                                      parse_topk_config, reset_memory, topk_config_text, topk_name,
                                      topk_rows, torch_topk_sets)

ROUNDS = 5              # rounds of the logits cases and their ceiling, timed in turn


class PrefillCase(NamedTuple):
    """One indexer layer's chunked prefill: a prompt in chunks, its logits budget (bytes), its
    compress ratio and dtype."""
    prompt: int
    chunk: int
    budget: int
    ratio: int
    dtype: torch.dtype


class Bench:
    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.device = torch.device("cpu" if smoke else "cuda")
        if smoke:
            self.M, self.N, self.H, self.D, self.K = 24, 200, 8, 32, 16
            self.dtypes = [torch.float32]
            self.mm = 128
        else:
            self.M, self.N, self.H, self.D, self.K = 4096, 65536, 64, 128, 2048
            self.dtypes = [torch.bfloat16, FP8]
            self.mm = 8192
        self.rows: list[dict] = []
        self.results: dict = {}
        self.gen = torch.Generator(device=self.device).manual_seed(1234)

    # -- helpers --------------------------------------------------------------------------------
    def ms(self, fn, rep=200) -> float:
        if self.smoke:
            times = []
            for _ in range(3):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
            return statistics.median(times)
        return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen, device=self.device)

    def rand(self, *shape):
        return torch.rand(*shape, generator=self.gen, device=self.device)

    def row(self, section, case, value, unit, versus="", ratio=None, goal="", met=None):
        self.rows.append(dict(section=section, case=case, value=value, unit=unit, versus=versus,
                              ratio=ratio, goal=goal, met=met))
        r = f"{ratio:.3f}" if ratio is not None else ""
        print(f"  {section:<14} {case:<34} {value:>12.3f} {unit:<8} {r:>7} {goal}",
              file=sys.stderr, flush=True)

    def inputs(self, dtype, causal):
        m, n, h, d = self.M, self.N, self.H, self.D
        q32 = self.randn(m, h, d)
        kv32 = self.randn(n, d)
        w = self.randn(m, h) / h ** 0.5
        scale = self.rand(n) + 0.5
        if dtype == FP8:
            row = kv32.abs().amax(1).clamp(min=1e-6) / 448.0
            q, kv, scale = q32.to(FP8), (kv32 / row[:, None]).to(FP8), scale * row
        else:
            q, kv = q32.to(dtype), kv32.to(dtype)
        ks = torch.zeros(m, dtype=torch.int32, device=self.device)
        ke = causal_ends(m, n, self.device) if causal else torch.full(
            (m,), n, dtype=torch.int32, device=self.device)
        pairs = int((ke - ks).sum())
        return q, kv, scale.float(), w, ks, ke, pairs

    # -- sections -------------------------------------------------------------------------------
    def ceiling_products(self):
        """{dtype name: (a function running the product, its FLOPs)} for the ceilings."""
        n = self.mm
        a, b = self.randn(n, n), self.randn(n, n)
        if self.smoke:
            return {"float32": (lambda: a @ b, 2 * n ** 3)}
        a16, b16 = a.bfloat16(), b.bfloat16()
        a8, b8 = a.to(FP8), b.to(FP8).t()            # _scaled_mm wants b column-major
        one = torch.ones((), device=self.device)
        return {"bf16": (lambda: torch.matmul(a16, b16), 2 * n ** 3),
                "fp8": (lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                                 out_dtype=torch.bfloat16, use_fast_accum=True),
                        2 * n ** 3)}

    def ceilings(self):
        self.products = self.ceiling_products()
        self.results["ceiling_tflops"] = {}
        for name, (fn, flops) in self.products.items():
            tf = flops / self.ms(fn) / 1e9
            self.results["ceiling_tflops"][name] = tf
            what = "torch._scaled_mm" if name == "fp8" else "torch.matmul"
            self.row("ceiling", f"{name} {what} {self.mm}^3", tf, "TFLOP/s")

    def _logits_call(self, args, config=None, clean=True):
        q, kv, scale, w, ks, ke = args
        out = torch.empty((self.M, row_stride_elems(self.N)), dtype=torch.float32,
                          device=self.device)[:, :self.N]
        return lambda: indexer.mqa_logits(q, kv, scale, w, ks, ke, out, clean=clean,
                                          config=config)

    def _logits_tflops(self, args, pairs, config=None):
        t = self.ms(self._logits_call(args, config))
        return 2 * pairs * self.H * self.D / t / 1e9, t

    def sweep(self):
        out = {}
        for dtype in self.dtypes:
            q, kv, scale, w, ks, ke, pairs = self.inputs(dtype, causal=False)
            cands = ([logits_mod.default_config(dtype, self.H, self.D, device=self.device.type)]
                     if self.smoke else logits_mod.candidate_configs(dtype, self.H, self.D))
            timings = []
            for cfg in cands:
                try:
                    tf, _ = self._logits_tflops((q, kv, scale, w, ks, ke), pairs, cfg)
                except Exception as e:  # a config the compiler rejects is reported, not fatal
                    print(f"  sweep {dtype} {cfg}: failed: {e!r:.200}", file=sys.stderr)
                    continue
                timings.append((tf, cfg))
                self.row("sweep logits", f"{dtype_name(dtype)} {cfg}", tf, "TFLOP/s")
            best = max(timings, key=lambda x: x[0])[1]
            if not self.smoke:
                for paged in (False, True):
                    logits_mod.set_config(dtype, self.H, self.D, paged, best)
            out[dtype_name(dtype)] = {"best": str(best), "all": {str(c): tf for tf, c in timings}}
        # top-k
        x = self.randn(self.M, self.N)
        ks = torch.zeros(self.M, dtype=torch.int32, device=self.device)
        ke = torch.full((self.M,), self.N, dtype=torch.int32, device=self.device)
        cands = [topk_mod.default_config(self.K, self.device.type)]
        if not self.smoke:
            cands = topk_mod.sweep_configs(self.K)
        timings = []
        for cfg in cands:
            try:
                t = self.ms(lambda: indexer.top_k_per_row(x, ks, ke, self.K, config=cfg))
            except Exception as e:
                print(f"  sweep topk {cfg}: failed: {e!r:.200}", file=sys.stderr)
                continue
            timings.append((t, cfg))
            self.row("sweep topk", topk_name(cfg), t, "ms")
        self.topk_config = min(timings, key=lambda x: x[0])[1]
        out["topk"] = {"best": topk_name(self.topk_config),
                       "all": {topk_name(c): t for t, c in timings}}
        self.results["sweep"] = out

    def logits(self):
        """Full rows, causal rows (clean and not) and the dtype's ceiling, timed in turn over
        ROUNDS rounds: the GPU's clock follows its temperature and power, so a ceiling timed
        minutes apart (cooler, at the run's start) would not be the kernel's."""
        products = getattr(self, "products", None) or self.ceiling_products()
        rounds = 1 if self.smoke else ROUNDS
        res = {}
        for dtype in self.dtypes:
            name = dtype_name(dtype)
            product, product_flops = products[name]
            # (q, kv, scale, w, ks, ke, pairs)
            full, causal = self.inputs(dtype, causal=False), self.inputs(dtype, causal=True)
            cases = {"ceiling": product,
                     "full": self._logits_call(full[:-1]),
                     "causal": self._logits_call(causal[:-1]),
                     "causal_unclean": self._logits_call(causal[:-1], clean=False)}
            times = {case: [] for case in cases}
            for _ in range(rounds):
                for case, fn in cases.items():
                    times[case].append(self.ms(fn, rep=100))
            med = {case: statistics.median(t) for case, t in times.items()}
            flops = {"full": 2 * full[-1] * self.H * self.D,
                     "causal": 2 * causal[-1] * self.H * self.D}
            flops["causal_unclean"] = flops["causal"]
            c = product_flops / med["ceiling"] / 1e9
            # per round: the kernel against the ceiling of the same round
            frac = {case: statistics.median(flops[case] / t / (product_flops / tc)
                                            for t, tc in zip(times[case], times["ceiling"]))
                    for case in flops}
            speed = statistics.median(t_full / t_causal for t_full, t_causal
                                      in zip(times["full"], times["causal"]))
            goal = {torch.bfloat16: 0.95, FP8: 0.90}.get(dtype)
            self.row(f"logits {name}", "ceiling, in the same rounds", c, "TFLOP/s")
            entry = {"ceiling_tflops": c, "rounds": rounds, "times_ms": times}
            for case, rows in (("full", "full rows"), ("causal", "causal rows")):
                q, kv, scale, w, ks, ke, pairs = full if case == "full" else causal
                tf = flops[case] / med[case] / 1e9
                self.row(f"logits {name}", rows, tf, "TFLOP/s", f"ceiling {name}", frac[case],
                         f">= {goal:.0%} of ceiling" if (goal and case == "full") else "",
                         (frac[case] >= goal) if (goal and case == "full") else None)
                t_ref = self.ms(lambda: ref.logits(q, kv, scale, w, ks, ke, dtype=torch.float32,
                                                   max_temp_bytes=2 << 30), rep=50)
                ref_tf = flops[case] / t_ref / 1e9
                self.row(f"logits {name}", f"{rows}: torch reference (fp32)", ref_tf,
                         "TFLOP/s", "kernel/ref time", t_ref / med[case])
                entry[case] = dict(ms=med[case], tflops=tf, pairs=pairs,
                                   fraction_of_ceiling=frac[case], reference_ms=t_ref,
                                   reference_tflops=ref_tf)
            entry["causal"]["ms_unclean"] = med["causal_unclean"]
            entry["causal_speedup"] = speed
            self.row(f"logits {name}", "causal speedup over full (time)", speed, "x",
                     "", None, ">= 1.8x", speed >= 1.8)
            self.row(f"logits {name}", "causal, clean=False (driver's mode)",
                     flops["causal"] / med["causal_unclean"] / 1e9, "TFLOP/s",
                     f"ceiling {name}", frac["causal_unclean"])
            entry["config"] = str(logits_mod.default_config(dtype, self.H, self.D,
                                                            device=self.device.type))
            res[name] = entry
        self.results["logits"] = res

    def topk(self):
        cfg = getattr(self, "topk_config", None)
        res = {"config": topk_name(cfg or topk_mod.default_config(self.K, self.device.type))}
        for causal in (False, True):
            x, ks, ke = topk_rows(self.randn(self.M, self.N), causal)
            out = torch.empty((self.M, self.K), dtype=torch.int32, device=self.device)
            t = self.ms(lambda: indexer.top_k_per_row(x, ks, ke, self.K, out, config=cfg))
            t_unsorted = self.ms(lambda: torch.topk(x, self.K, dim=1, sorted=False))
            t_sorted = self.ms(lambda: torch.topk(x, self.K, dim=1, sorted=True))
            _, path = indexer.top_k_per_row(x, ks, ke, self.K, out, config=cfg, return_path=True)
            same = torch.equal(out.long().sort(1).values, torch_topk_sets(x, ke, self.K))
            valid = ref.topk_validity(x, out, ks, ke, self.K)
            rows = "causal rows" if causal else "full rows"
            self.row(f"topk {self.K}", f"{rows}: kernel", t, "ms")
            self.row(f"topk {self.K}", f"{rows}: vs torch.topk(sorted=False)", t_unsorted / t, "x",
                     "", None, ">= 4x", t_unsorted / t >= 4)
            self.row(f"topk {self.K}", f"{rows}: vs torch.topk(sorted=True)", t_sorted / t, "x")
            self.row(f"topk {self.K}", f"{rows}: identical sets / exact rows",
                     float(same), "bool", "", float(valid.float().mean()), "identical", same)
            res["causal" if causal else "full"] = dict(
                ms=t, torch_unsorted_ms=t_unsorted, torch_sorted_ms=t_sorted,
                speedup_unsorted=t_unsorted / t, speedup_sorted=t_sorted / t,
                identical_sets=same, exact_rows=int(valid.sum()), rows=self.M,
                paths=topk_mod.path_counts(path))
        self.results["topk"] = res

    # -- the chunked prefill --------------------------------------------------------------------
    def prefill_case(self) -> PrefillCase:
        if self.smoke:
            return PrefillCase(prompt=240, chunk=100, budget=16 << 10, ratio=4,
                               dtype=torch.float32)
        return PrefillCase(prompt=ARGS.prompt, chunk=ARGS.chunk, budget=ARGS.budget_mb << 20,
                           ratio=4, dtype=FP8)

    def prefill_inputs(self, case: PrefillCase):
        """q, w and the dense kv of the whole prompt."""
        h, d, dtype = self.H, self.D, case.dtype
        n_kv = case.prompt // case.ratio
        # q in slices: its float32 temporaries must not share a cached segment with anything
        # that stays, or empty_cache() could not give them back and the default allocator
        # would start the measured pass with gigabytes already cached.
        q_all = torch.empty((case.prompt, h, d), dtype=dtype, device=self.device)
        for r in range(0, case.prompt, 8192):
            q_all[r:r + 8192] = self.randn(min(8192, case.prompt - r), h, d).to(dtype)
        w_all = self.randn(case.prompt, h) / h ** 0.5
        kv32 = self.randn(n_kv, d)
        row = kv32.abs().amax(1).clamp(min=1e-6) / 448.0
        kv_all = (kv32 / row[:, None]).to(dtype)
        scale_all = (row * (self.rand(n_kv) + 0.5)).float()
        return q_all, w_all, kv_all, scale_all

    def prefill_runner(self, case: PrefillCase):
        """``(run, host_s)``: ``run(stats=None, on_piece=None)`` prefills the prompt chunk by
        chunk, appending each call's host time to ``host_s``."""
        q_all, w_all, kv_all, scale_all = self.prefill_inputs(case)
        out = torch.empty((case.chunk, self.K), dtype=torch.int32, device=self.device)
        tcfg = getattr(self, "topk_config", None)
        scope = None if alloc_importable() else contextlib.nullcontext
        host_s = []

        def run(stats=None, on_piece=None):
            for t0 in range(0, case.prompt, case.chunk):
                ql = min(case.chunk, case.prompt - t0)
                seq = t0 + ql
                t = time.perf_counter()
                prefill_topk(q_all[t0:seq], w_all[t0:seq], [ql], [seq],
                             DenseKV(kv_all[:seq // case.ratio], scale_all[:seq // case.ratio]),
                             k=self.K, max_logits_bytes=case.budget, compress_ratio=case.ratio,
                             out=out[:ql], stats=stats, on_piece=on_piece, topk_config=tcfg,
                             workspace=scope)
                host_s.append(time.perf_counter() - t)

        return run, host_s

    def sync(self):
        if not self.smoke:
            torch.cuda.synchronize()

    def median_wall(self, fn):
        walls = []
        for _ in range(1 if self.smoke else 3):
            self.sync()
            t = time.perf_counter()
            fn()
            self.sync()
            walls.append(time.perf_counter() - t)
        return statistics.median(walls), walls

    def kernels_alone(self, calls) -> float:
        """The median wall of every piece's logits and top-k again, back to back into one
        buffer, with no planning, allocation or host work between them; ``calls`` are the
        ``(piece, logits, select)`` that ``prefill_topk`` passed its ``on_piece``."""
        buf = torch.empty(max(p.num_rows * p.stride for p, _, _ in calls), device=self.device)

        def kernels():
            for piece, logits, select in calls:
                m, st = piece.num_rows, piece.stride
                view = buf[:m * st].view(m, st)[:, :piece.width]
                logits(out=view)
                select(view)

        return self.median_wall(kernels)[0]

    def prefill(self, arena_installed: bool, record: bool = True):
        """One prefill measurement; later rounds (record False) add their wall to the first
        round's entry and print no rows."""
        case = self.prefill_case()
        run, host_s = self.prefill_runner(case)
        # Memory is measured over the first pass, when an allocator meets every piece size
        # for the first time (the caching allocator grows there; later passes reuse its cache).
        # Triton compiles its specializations during that pass too; compiling takes no device
        # memory, but it makes this pass's time meaningless, so it is not timed.
        self.sync()
        reset_memory(arena_installed, self.smoke)
        mem0 = memory(arena_installed, self.smoke)
        run()
        self.sync()
        mem1 = memory(arena_installed, self.smoke)
        host_s.clear()
        wall, walls = self.median_wall(run)
        # Host time a call: planning, ks/ke, allocation and launches (the calls do not wait for
        # the GPU). Where it exceeds a call's GPU time the GPU idles.
        host_per_call = statistics.median(host_s)
        stats, calls = PrefillStats(), []
        self.sync()
        t = time.perf_counter()
        run(stats, on_piece=lambda *call: calls.append(call))
        self.sync()
        wall_timed = time.perf_counter() - t
        # The event times above split the kernels; they cannot be subtracted from the wall,
        # since they also count the gaps the instrumented run's own host work leaves.
        kernels_s = self.kernels_alone(calls)
        key = "prefill_arena" if arena_installed else "prefill"
        if not record:
            self.results[key]["round_walls_s"].append(wall)
            return
        self.record_prefill(case, arena_installed, stats, wall=wall, walls=walls,
                            wall_timed=wall_timed, kernels_s=kernels_s,
                            host_per_call=host_per_call, mem0=mem0, mem1=mem1)

    def record_prefill(self, case: PrefillCase, arena_installed: bool, stats: PrefillStats, *,
                       wall, walls, wall_timed, kernels_s, host_per_call, mem0, mem1):
        """The first round's entry in the results and its rows in the table."""
        other = wall - kernels_s
        tag = "prefill arena" if arena_installed else "prefill"
        tcfg = getattr(self, "topk_config", None)
        res = dict(prompt=case.prompt, chunk=case.chunk, compress_ratio=case.ratio,
                   budget_bytes=case.budget, dtype=dtype_name(case.dtype), wall_s=wall,
                   walls_s=walls, instrumented_wall_s=wall_timed, logits_s=stats.logits_s,
                   topk_s=stats.topk_s, kernels_s=kernels_s, else_s=other,
                   else_fraction=other / wall, host_per_call_s=host_per_call,
                   pieces=stats.pieces, max_piece_bytes=stats.max_piece_bytes,
                   round_walls_s=[wall],
                   # What the pieces ran: a comparison across processes means nothing unless
                   # both ran the same kernels.
                   logits_config=repr(logits_mod.default_config(case.dtype, self.H, self.D,
                                                                device=self.device.type)),
                   topk_config=topk_name(tcfg or topk_mod.default_config(self.K,
                                                                         self.device.type)),
                   arena_installed=arena_installed, memory_before=mem0, memory_after=mem1)
        self.row(tag, f"{case.prompt} tokens / {case.chunk}: wall", wall * 1e3, "ms")
        self.row(tag, "logits (events)", stats.logits_s * 1e3, "ms", "of wall",
                 stats.logits_s / wall)
        self.row(tag, "top-k (events)", stats.topk_s * 1e3, "ms", "of wall", stats.topk_s / wall)
        self.row(tag, "kernels alone, back to back", kernels_s * 1e3, "ms", "of wall",
                 kernels_s / wall)
        self.row(tag, "everything else (wall - kernels)", other * 1e3, "ms", "of wall",
                 other / wall, "< 5%", other / wall < 0.05)
        self.row(tag, "host time a call (median)", host_per_call * 1e3, "ms")
        self.row(tag, f"pieces (max {stats.max_piece_bytes / MiB:.1f} MiB)", stats.pieces,
                 "pieces")
        if not self.smoke:
            taken = (mem0["free"] - mem1["free"]) / MiB
            self.row(tag, "device memory taken by the 1st pass", taken, "MiB",
                     "cudaMemGetInfo")
            self.row(tag, "peak allocated over the 1st pass",
                     (mem1["peak_allocated"] - mem0["allocated"]) / MiB, "MiB")
            self.row(tag, "peak reserved over the 1st pass",
                     (mem1["peak_reserved"] - mem0["reserved"]) / MiB, "MiB")
            res["device_memory_taken_mib"] = taken
        key = "prefill_arena" if arena_installed else "prefill"
        self.results[key] = res

    def compare_prefill(self):
        """The goal across the alternated rounds: the prefill is no slower with the arena."""
        base, arena = self.results.get("prefill"), self.results.get("prefill_arena")
        if not all(isinstance(r, dict) and "round_walls_s" in r for r in (base, arena)):
            return
        for field in ("logits_config", "topk_config"):
            if base[field] != arena[field]:
                self.row("prefill arena", f"{field}: {arena[field]} vs {base[field]}", 0, "",
                         "prefill", None, "same kernels", False)
                return
        ratio = statistics.median(arena["round_walls_s"]) / statistics.median(base["round_walls_s"])
        self.results["prefill_wall_ratio"] = ratio
        self.row("prefill arena", f"wall / PyTorch's, {len(base['round_walls_s'])} rounds alternated",
                 ratio, "x", "prefill", ratio, "<= 1.01 (noise)", ratio <= 1.01)


def print_table(rows):
    print()
    harness.table("bench_indexer", ("section", "case", "value", "unit", "ratio", "vs", "goal", "met"),
                  [(r["section"], r["case"], f"{r['value']:.3f}", r["unit"],
                    "" if r["ratio"] is None else f"{r['ratio']:.3f}", r["versus"], r["goal"],
                    "" if r["met"] is None else ("yes" if r["met"] else "NO")) for r in rows],
                  justify="left", width=150)


def main():
    args = ARGS
    only = set(args.only.split(","))
    b = Bench(args.smoke)
    info = dict(torch=torch.__version__, triton=triton.__version__, smoke=args.smoke,
                arena_installed=bool(args.arena),
                time=time.strftime("%Y-%m-%d %H:%M:%S %Z"), argv=sys.argv[1:])
    if not args.smoke:
        info["device"] = torch.cuda.get_device_name()
    b.results["info"] = info
    print(f"# bench_indexer: {info}", file=sys.stderr)
    fixed = parse_logits_config(args.logits_config)
    if fixed is not None:
        for paged in (False, True):
            logits_mod.set_config(FP8, b.H, b.D, paged, fixed)
    if args.topk_config:
        b.topk_config = parse_topk_config(args.topk_config, b.K)
    if "ceilings" in only:
        b.ceilings()
    if "sweep" in only and not args.no_sweep:
        b.sweep()
    if "logits" in only:
        b.logits()
    if "topk" in only:
        b.topk()
    if "prefill" in only:
        both = not (args.arena or args.no_arena_run or args.smoke)
        # A B A B: clocks and the order of the passes must not decide the comparison.
        for r in range(args.prefill_rounds if both else 1):
            b.prefill(arena_installed=bool(args.arena), record=r == 0)
            if both:
                child_run(b, record=r == 0)
        b.compare_prefill()
    print_table(b.rows)
    if args.json:
        b.results["table"] = b.rows
        harness.write_json(args.json, b.results, indent=2)
        print(f"\nwrote {args.json}")


def child_run(b: Bench, record: bool = True) -> None:
    """The prefill again in a fresh process whose allocator is the arena (installing it must
    precede CUDA's initialisation, which this process is long past)."""
    if not alloc_importable():
        b.results["prefill_arena"] = {"skipped": "the alloc extension is not built"}
        return
    cfg = logits_mod.default_config(FP8, b.H, b.D)
    tk = getattr(b, "topk_config", None) or topk_mod.default_config(b.K)
    child = allocators.run_child(lambda path: allocators.python(
        str(Path(__file__).resolve()), "--arena", "--only", "prefill", "--json", path,
        "--prompt", str(ARGS.prompt), "--chunk", str(ARGS.chunk), "--budget-mb", str(ARGS.budget_mb),
        "--logits-config", logits_config_text(cfg), "--topk-config", topk_config_text(tk)),
        allocators.child_environ("arena"), timeout=600)
    if "error" in child:
        b.results["prefill_arena"] = {"failed": child["stderr"]}
        print(f"arena run failed:\n{child['stderr']}", file=sys.stderr)
        return
    result = child.get("prefill_arena")
    if not record:
        b.results["prefill_arena"]["round_walls_s"].append(result["wall_s"])
        return
    b.results["prefill_arena"] = result
    b.rows.extend(r for r in child.get("table", []) if r["section"] == "prefill arena")


if __name__ == "__main__":
    main()
