"""The allocators this project compares, and running a job under each one in a fresh process.

PyTorch reads PYTORCH_CUDA_ALLOC_CONF once, when it loads, and the arena must be installed before
CUDA starts, so every comparison runs each allocator in a process of its own: the parent starts a
child per allocator (``run_each``), the child sets itself up (``install``) and writes its result
as JSON to the path it is given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Allocator:
    name: str
    alloc_conf: str | None  # PYTORCH_CUDA_ALLOC_CONF of the child; None: unset (moot under the arena)
    scope: str | None       # alloc.install's scope, or None: PyTorch's allocator alone
    doc: str
    arena: tuple[tuple[str, str], ...] = ()  # alloc.Config fields this allocator sets over the environment's


ALLOCATORS: dict[str, Allocator] = {a.name: a for a in (
    Allocator("default", "", None, "PyTorch's caching allocator as it ships"),
    Allocator("expandable", "expandable_segments:True", None, "PyTorch's, with expandable segments"),
    Allocator("cuda-async", "backend:cudaMallocAsync", None, "the CUDA driver's stream-ordered pool"),
    Allocator("arena", None, "process", "this project's arena as PyTorch's allocator"),
    Allocator("arena-regions", None, "process", "the arena, its general pools in regions (no page mapping)",
              (("expandable", "off"),)),
    Allocator("arena-workspace", "", "workspace", "PyTorch's allocator, the workspaces from the arena's pool"),
)}


def parse_names(text: str, accepted: Sequence[str] = tuple(ALLOCATORS)) -> list[str]:
    """'a,b' -> ['a', 'b']; ValueError naming the unknown ones and what is accepted."""
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in accepted]
    if unknown or not names:
        raise ValueError(f"unknown allocator(s) {', '.join(unknown) or '(none)'}; "
                         f"accepted: {', '.join(accepted)}")
    return names


def child_environ(name: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child that runs under ``name``: PYTORCH_CUDA_ALLOC_CONF as the table
    says, and this tree first on PYTHONPATH so that the child imports what the parent did."""
    env = dict(os.environ if base is None else base)
    conf = ALLOCATORS[name].alloc_conf
    if conf is None:
        env.pop(ALLOC_CONF, None)
    else:
        env[ALLOC_CONF] = conf
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *(p for p in paths if p != ROOT)])
    return env


def check_environ(name: str) -> None:
    """In the child, before torch loads: PYTORCH_CUDA_ALLOC_CONF is what ``name`` needs."""
    expected = ALLOCATORS[name].alloc_conf
    if expected is not None and os.environ.get(ALLOC_CONF, "") != expected:
        raise SystemExit(f"allocator {name}: {ALLOC_CONF} must be {expected!r} before torch loads, "
                         f"found {os.environ.get(ALLOC_CONF)!r}")


def install(name: str, config=None) -> str | None:
    """In the child, before CUDA starts: installs the arena where ``name`` has it (``config``
    defaults to the environment's). Returns the scope, or None for PyTorch's allocators."""
    chosen = ALLOCATORS[name]
    if chosen.scope is not None:
        import dataclasses

        import alloc
        config = config if config is not None else alloc.from_env()
        alloc.install(dataclasses.replace(config, **dict(chosen.arena)), scope=chosen.scope)
    return chosen.scope


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join([ln for ln in text.strip().splitlines() if ln.strip()][-lines:]) or "no output"


def run_child(argv: Callable[[str], list[str]], env: Mapping[str, str], *, timeout: float | None = None,
              on_line: Callable[[str], None] | None = None, capture: bool = True,
              cwd: str | None = None) -> dict:
    """Runs ``argv(result_path)`` in a fresh process and returns the JSON its child wrote to
    result_path, or ``{"error": why, "stderr": its last 3000 characters, "exit_status": rc}``
    when it failed or ran past ``timeout`` seconds (with ``"result"``, what it wrote before it
    failed, if anything). ``on_line`` sees each line of its standard output as it comes;
    ``capture=False`` leaves both streams to the terminal."""
    with tempfile.TemporaryDirectory(prefix="arena-tools-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        with open(os.path.join(tmp, "stderr"), "w+") as err:
            proc = subprocess.Popen(argv(result_path), env=dict(env), cwd=cwd, text=True,
                                    stdout=subprocess.PIPE if capture else None,
                                    stderr=err if capture else None)
            timer = threading.Timer(timeout, proc.kill) if timeout else None
            if timer is not None:
                timer.start()
            try:
                for line in proc.stdout if capture else ():
                    if on_line is not None:
                        on_line(line)
                rc = proc.wait()
            finally:
                if timer is not None:
                    timer.cancel()
            err.seek(0)
            stderr = err.read()
        result = None
        if os.path.exists(result_path):
            with open(result_path) as f:
                result = json.load(f)
    if rc == 0 and result is not None:
        return result
    why = "timed out" if rc in (-9, 137) else f"exit status {rc}"
    out = {"error": f"{why}: {_tail(stderr) if capture else 'see its output above'}",
           "stderr": stderr[-3000:], "exit_status": rc}
    return out if result is None else {**out, "result": result}


def run_each(names: Sequence[str], argv: Callable[[str, str], list[str]], *, rounds: int = 1,
             timeout: float | None = None, on_line: Callable[[str, str], None] | None = None,
             on_result: Callable[[int, dict], None] | None = None,
             base: Mapping[str, str] | None = None) -> list[dict]:
    """Runs ``argv(name, result_path)`` under each allocator of ``names``, each in a fresh process
    set up by ``child_environ``, the rounds alternating (A B A B). Returns the results in run
    order, each with ``allocator`` set; a child that failed gives ``{"allocator": name, "error":
    why, "stderr": ...}``. ``on_result(round, result)`` sees each result as its child ends."""
    results = []
    for round_ in range(1, rounds + 1):
        for name in names:
            line = None if on_line is None else (lambda text, name=name: on_line(name, text))
            out = run_child(lambda path, name=name: argv(name, path), child_environ(name, base),
                            timeout=timeout, on_line=line)
            results.append(out if "allocator" in out else {"allocator": name, **out})
            if on_result is not None:
                on_result(round_, results[-1])
    return results


def summary(round_: int, result: dict) -> str:
    """One line of a finished run: its allocator, round and scalar figures (lists and tables left
    out), so that a comparison stopped by a time limit still leaves what it measured."""
    scalars = {k: v for k, v in result.items() if isinstance(v, (int, float, str, bool)) and k != "stderr"}
    return f"run: round {round_} " + json.dumps(scalars, separators=(",", ":"))


def stop_on_error(results: Sequence[dict]) -> None:
    """For a comparison that needs every run: the first failed one ends the program, with the
    end of its standard error."""
    for r in results:
        if "error" in r:
            raise SystemExit(f"{r['allocator']} failed: {r['error']}\n{r.get('stderr', '')}")


def without_option(argv: Sequence[str], option: str) -> list[str]:
    """``argv`` without ``option`` and its value (what a parent keeps from its children)."""
    out = list(argv)
    while option in out:
        i = out.index(option)
        del out[i:i + 2]
    return out


def write_result(path: str, result: dict) -> None:
    """The child's side: its result, where the parent reads it."""
    with open(path, "w") as f:
        json.dump(result, f)


def python(*args: str) -> list[str]:
    """A command line of this interpreter."""
    return [sys.executable, *args]
