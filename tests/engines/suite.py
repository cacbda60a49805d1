"""The engine conformance suite: the engine plugin against the engines' released code.

    ./run.sh engines [NAME...]     (NAME: vllm-0.33.0, vllm-0.13.0, sglang-0.5.23; default all)

For each pinned engine it makes or updates the environment (tests/engines/envs.py: several GB,
downloaded once), then runs tests/engines/conformance.py there four times, in fresh processes:
plugin off, process scope, workspace scope, and a bad INDEXER_ARENA_SCOPE. It checks, and prints:

- a bad setting, through the engine's own loader, ends the process with exit status 1 and one
  line, without a traceback;
- the plugin was loaded by the engine's own loader and installed where the worker starts, and no
  route for this version found nothing (every route applied; DeepGEMM's are applied when the
  engine imports it, which the run makes it do);
- both vLLM model runners reserve the workspace at their profile run (V2 exists from 0.33 on);
- the indexer's logits, called as the model code holds them, ran inside alloc.workspace(), and a
  decode batch over the budget ran outside it, counted once in alloc.memory_stats();
- the KV cache the engine sizes with the plugin on is the size with it off less one budget, within
  2 MiB (the workspace scope's pool holds PyTorch's 2 MiB small-block segment beside the budget);
- vLLM's sleep gives the workspace back and its wake takes it again;
- on a Ray cluster on the loopback (tests/engines/conformance_ray.py: a node with the driver's
  settings, one without any INDEXER_ARENA_* variable, one with settings of its own), every worker
  of each of vLLM's Ray paths runs with the driver's scope and budget, logs its line, and the
  node whose own settings differ says so.

Exit status 1 when any check fails. Too heavy for CI (CI runs tests/alloc/test_engines.py);
benchmarks/RESULTS.md records the last output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.engines import envs

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
TOLERANCE = 2 * MiB


def run_one(py: Path, engine: envs.Engine, scope: str) -> dict:
    done = subprocess.run([str(py), str(HERE / "conformance.py"), engine.kind, scope],
                          capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{engine.name} {scope}: the run failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


BAD_SCOPE_LINE = "indexer-arena: invalid value 'everywhere' for 'INDEXER_ARENA_SCOPE'"


def bad_setting(py: Path, engine: envs.Engine) -> dict:
    """A bad INDEXER_ARENA_SCOPE through the engine's own plugin loader."""
    done = subprocess.run([str(py), str(HERE / "conformance.py"), engine.kind, "bad"],
                          capture_output=True, text=True, timeout=1800)
    # The line comes through the engine's logger (vLLM 0.13's prints to stdout, 0.33's and
    # SGLang's to stderr), after the logger's own prefix.
    out = done.stdout + done.stderr
    lines = [line[line.index("indexer-arena: "):] for line in out.splitlines()
             if "indexer-arena: " in line]
    return {"returncode": done.returncode, "went_on": "went on" in done.stdout,
            "traceback": "Traceback" in out, "lines": len(lines),
            "last_line": lines[-1] if lines else ""}


def failures(engine: envs.Engine, runs: dict[str, dict]) -> list[str]:
    """What each check found wrong (empty: all passed)."""
    off, bad = runs["off"], []
    budget = off["budget_mb"] * MiB
    refused = runs["bad"]
    if refused["returncode"] != 1 or refused["went_on"] or refused["traceback"] or refused["lines"] != 1 \
            or BAD_SCOPE_LINE not in refused["last_line"]:  # in the engine's log format
        bad.append(f"a bad INDEXER_ARENA_SCOPE did not end the process with one line: {refused}")
    if off["loaded"] or set(off["routes"]) - set(off["always"]):
        bad.append("off: the plugin registered more than its always-on routes without "
                   "INDEXER_ARENA_SCOPE")
    for scope in ("process", "workspace"):
        run = runs[scope]
        if run["version"] != engine.version:
            bad.append(f"{scope}: ran {run['version']}, not {engine.version}")
        if not (run["loaded"] and run["installed"]):
            bad.append(f"{scope}: not loaded by the engine's loader, or not installed at the worker's start")
        bad += [f"{scope}: route {name} is {state}" for name, state in run["routes"].items()
                if state != "applied"]
        if engine.kind == "vllm" and {k for k, v in run["runners"].items() if v} != set(engine.runners):
            bad.append(f"{scope}: model runners reserving at profile_run: {run['runners']}")
        logits = run["logits"]
        if not (logits["prefill"][1] and logits["decode"][1]) or logits["decode_over_budget"][1] \
                or logits["outside"][0] != 1:
            bad.append(f"{scope}: logits routing {logits}")
        info = [line for line in run["log"] if line.startswith("INFO indexer-arena: ")]
        loaded = [line for line in info if line.endswith(
            f": {scope} scope, budget {off['budget_mb']} MiB (from this node's environment)")]
        started = [line for line in info if " routes applied: " in line]
        other = [line for line in run["log"] if not line.startswith("INFO")
                 and "served outside the arena" not in line]  # the decode over budget's warning
        if len(loaded) != 1 or len(started) != 1 or len(info) != 2 \
                or f" {engine.version}, {scope} scope" not in started[0] or other:
            bad.append(f"{scope}: the plugin's log is not the load's line and the start's naming "
                       f"the version: {run['log']}")
        lost = off["kv_cache_bytes"] - run["kv_cache_bytes"]
        if abs(lost - budget) > TOLERANCE:
            bad.append(f"{scope}: KV cache {lost / MiB:.0f} MiB smaller with the plugin, not one budget")
        moved = (run.get("sleep_freed_mb", 0) * MiB, run.get("wake_took_mb", 0) * MiB)
        if engine.kind == "vllm" and not all(budget <= m <= budget + TOLERANCE for m in moved):
            bad.append(f"{scope}: sleep freed {run['sleep_freed_mb']} MiB, wake took {run['wake_took_mb']} MiB")
    return bad


def table(engine: envs.Engine, runs: dict[str, dict]) -> list[str]:
    off = runs["off"]
    rows = [f"{engine.name} (torch {off['torch']}), budget {off['budget_mb']} MiB:"]
    rows.append(f"  bad scope exit {runs['bad']['returncode']}, traceback {runs['bad']['traceback']}, "
                f"lines {runs['bad']['lines']}, "
                f"last line: {runs['bad']['last_line']}")
    for scope, run in runs.items():
        if scope == "bad":
            continue
        kv = run["kv_cache_bytes"] / MiB
        line = f"  {scope:9} KV cache {kv:,.0f} MiB"
        if scope != "off":
            applied = sum(s == "applied" for s in run["routes"].values())
            line += (f" (off - {(off['kv_cache_bytes'] - run['kv_cache_bytes']) / MiB:.0f} MiB); "
                     f"routes applied {applied}/{len(run['routes'])}; logits in workspace: prefill "
                     f"{run['logits']['prefill'][1]}, decode {run['logits']['decode'][1]}, decode "
                     f"over budget outside {not run['logits']['decode_over_budget'][1]} "
                     f"(arena.outside.calls {run['logits']['outside'][0]})")
            if "runners" in run:
                line += f"; runners reserving {sorted(k for k, v in run['runners'].items() if v)}"
                line += f"; sleep frees {run['sleep_freed_mb']:.0f} MiB, wake takes {run['wake_took_mb']:.0f} MiB"
            if "logits_budget_mb" in run["logits"]:
                line += (f"; SGLang's logits budget {run['logits']['logits_budget_mb']} MiB "
                         f"(off: {off['logits']['logits_budget_mb']} MiB)")
        rows.append(line)
        rows += [f"            log: {entry}" for entry in run.get("log", [])]
    return rows


def ray_cluster(py: Path) -> dict:
    done = subprocess.run([str(py), str(HERE / "conformance_ray.py")], capture_output=True,
                          text=True, timeout=1200,
                          env={k: v for k, v in os.environ.items()
                               if not k.startswith("INDEXER_ARENA_")})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": done.stderr[-3000:] or f"exit status {done.returncode}"}
    return json.loads(lines[-1])


def _seen(worker: dict) -> str:
    return "off" if worker["scope"] is None else f"{worker['scope']} {worker['budget_mb']} MiB"


def ray_failures(ray: dict) -> list[str]:
    """Every worker on every node runs with the driver's settings and logs its line; the node
    with settings of its own says they differ."""
    if "error" in ray:
        return [f"Ray cluster: the run failed: {ray['error'][-600:]}"]
    want, bad = _seen(ray["driver"]), []
    if want == "off":
        bad.append("Ray cluster: the driver's plugin is off")
    for path, nodes in ray["paths"].items():
        if "error" in nodes:
            bad.append(f"Ray cluster: {path}: {nodes['error'][-300:]}")
            continue
        for node, worker in nodes.items():
            if _seen(worker) != want:
                bad.append(f"Ray cluster: {path}, node {node}: {_seen(worker)}, not the driver's {want}")
            if not any("indexer-arena: " in line for line in worker["log"]):
                bad.append(f"Ray cluster: {path}, node {node}: the plugin logged no line")
        # Where vLLM lets a node's own values stand (RayExecutorV2's setdefault), node c's
        # worker says its settings differ; elsewhere vLLM overwrote them with the driver's.
        if path.startswith("RayExecutorV2") and not any(
                "differ from the driver's" in line for line in nodes.get("c", {}).get("log", [])):
            bad.append(f"Ray cluster: {path}, node c: no line saying its settings differ")
    return bad


def ray_table(ray: dict) -> list[str]:
    if "error" in ray:
        return ["  Ray cluster: the run failed"]
    rows = [f"  Ray cluster (ray {ray['ray']}, three raylets on 127.0.0.1; node a: the driver's "
            f"settings, b: no INDEXER_ARENA_*, c: its own, process 1024 MiB), driver "
            f"{_seen(ray['driver'])}, {ray['seconds']} s; scope and budget inside each worker:"]
    for path, nodes in ray["paths"].items():
        if "error" in nodes:
            rows.append(f"    {path:44} failed: {nodes['error'][-300:]}")
            continue
        rows.append(f"    {path:44} " + " | ".join(f"node {n}: {_seen(w):15}" for n, w in nodes.items()))
        for node, worker in nodes.items():
            rows += [f"        {node}: {line}" for line in worker["log"] if "indexer-arena" in line]
    return rows


def main(argv: list[str]) -> int:
    chosen = [e for e in envs.ENGINES if not argv or e.name in argv]
    unknown = set(argv) - {e.name for e in envs.ENGINES}
    if unknown:
        print(f"unknown engine {', '.join(sorted(unknown))}; known: "
              f"{', '.join(e.name for e in envs.ENGINES)}", file=sys.stderr)
        return 2
    failed = []
    for engine in chosen:
        started = time.monotonic()
        py = envs.ensure(engine)
        runs = {scope: run_one(py, engine, scope) for scope in ("off", "process", "workspace")}
        runs["bad"] = bad_setting(py, engine)
        print("\n".join(table(engine, runs)), flush=True)
        bad = failures(engine, runs)
        if engine.ray:
            ray = ray_cluster(py)
            print("\n".join(ray_table(ray)), flush=True)
            bad += ray_failures(ray)
        failed += [f"{engine.name}: {b}" for b in bad]
        print(f"  {'FAILED' if bad else 'passed'} in {time.monotonic() - started:.0f} s", flush=True)
    for line in failed:
        print(line)
    print(f"{len(chosen) - len({f.split(':')[0] for f in failed})} passed, "
          f"{len({f.split(':')[0] for f in failed})} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
