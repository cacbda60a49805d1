"""The engine environments of the conformance suite: one virtual environment per pinned engine
release, under .engines/<name> (ignored by git; ENGINES_DIR moves it), made from the package
registry with the engine's own pins.

An engine's wheel is installed without its dependencies, then its torch pin (with torch's own
dependencies), then the engine's other requirements less the GPU kernel libraries and media codecs
in SKIPPED: those need a GPU driver to import and none of the code the suite checks imports them
at module level. This package goes in last, as a user installs it, so its entry points are
registered.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Engine:
    name: str        # the environment's folder and the suite's label
    package: str     # the distribution on the registry
    version: str
    torch: str       # the engine's torch pin
    kind: str        # "vllm" or "sglang": which checks run
    runners: tuple[str, ...] = ()  # vLLM's model runners in this version (v1: gpu_model_runner,
                                   # v2: gpu/model_runner, the default from 0.33 on)
    ray: str = ""    # the Ray requirement the Ray-cluster check installs (without its GPU extras)


ENGINES = (
    # vLLM 0.13 requires ray[cgraph]>=2.48.0 (cgraph: CuPy, for GPUs); 0.33 pins no Ray.
    Engine("vllm-0.33.0", "vllm", "0.33.0", "2.14.0", "vllm", ("v1", "v2"), "ray>=2.48.0"),
    Engine("vllm-0.13.0", "vllm", "0.13.0", "2.9.0", "vllm", ("v1",), "ray>=2.48.0"),
    Engine("sglang-0.5.23", "sglang", "0.5.23", "2.14.1", "sglang"),
)

# Compiled GPU kernels, their toolchains and media codecs: they need a driver (or pull another
# torch) and are imported lazily by the modules the suite loads.
SKIPPED = {
    "b12x", "cuda-python", "decord2", "deepseek-recipe", "flash-attn-4",
    "flashinfer-python", "humming-kernels", "instanttensor", "fastsafetensors", "kernels",
    "nvidia-cudnn-frontend", "nvidia-cutlass-dsl", "nvidia-mathdx", "nvshmem4py-cu13",
    "pynvvideocodec", "quack-kernels", "ray", "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla",
    "sglang-kernel", "smg-grpc-servicer", "tilelang", "timm", "tokenspeed-mla",
    "torch-memory-saver", "torchaudio", "torchcodec", "av",
    "modelscope", "py-spy", "tml-renderers", "torch",
}


def engines_dir() -> Path:
    return Path(os.environ.get("ENGINES_DIR") or ROOT / ".engines")


def python_of(engine: Engine) -> Path:
    return engines_dir() / engine.name / "bin" / "python"


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pip(py: Path, *args: str, log) -> None:
    cmd = [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args]
    log(" ".join(cmd[1:]))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip failed ({' '.join(args)}):\n{done.stderr[-3000:]}")


def _requirements(py: Path, engine: Engine) -> list[str]:
    """The engine's own requirements for this platform, less SKIPPED, as pip takes them."""
    code = ("import importlib.metadata as m, json;"
            f"print(json.dumps(m.requires({engine.package!r}) or []))")
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True).stdout
    keep = []
    for req in json.loads(out):
        if "extra ==" in req:
            continue
        name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0)
        if _normal(name) not in SKIPPED:
            keep.append(req)
    return keep


def _stamp(engine: Engine) -> str:
    """Changes when this package's sources or the pins change: the package is reinstalled."""
    digest = hashlib.sha256(repr(engine).encode())
    for path in sorted([*ROOT.glob("alloc/*.py"), *ROOT.glob("csrc/**/*.[ch]*"), ROOT / "pyproject.toml",
                        ROOT / "setup.py", Path(__file__)]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def ensure(engine: Engine, log=lambda s: print(s, file=sys.stderr)) -> Path:
    """The engine's environment, made or brought up to date; returns its python."""
    env = engines_dir() / engine.name
    py = python_of(engine)
    done = env / f".installed-{_stamp(engine)}"
    if done.exists():
        return py
    if not py.exists():
        log(f"making {env}")
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    pins = env / "pins.txt"  # nothing may move torch off the engine's pin
    pins.write_text(f"torch=={engine.torch}\n")
    constraint = ["-c", str(pins)]
    _pip(py, f"torch=={engine.torch}", *constraint, log=log)
    _pip(py, "--no-deps", f"{engine.package}=={engine.version}", log=log)
    _pip(py, *_requirements(py, engine), *constraint, log=log)
    if engine.ray:
        _pip(py, engine.ray, *constraint, log=log)
    _pip(py, "--force-reinstall", "--no-deps", str(ROOT), log=log)
    _pip(py, "cffi>=1.17", *constraint, log=log)
    for old in env.glob(".installed-*"):
        old.unlink()
    done.touch()
    return py
