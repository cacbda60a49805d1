#!/usr/bin/env bash
# One entry point that sets everything up on a fresh machine and then runs the job asked for.
#   ./run.sh main    the seed workload: on a GPU, every allocator side by side; on the CPU, the
#                    story (the fit check's verdicts for the seed's H200 and GB10), then the
#                    host-backed arena simulation (--chunks: the per-chunk table)
#   ./run.sh tests   the test suite (GPU tests run where CUDA is, and are skipped elsewhere)
#   ./run.sh engines the engine conformance suite: the engine plugin against the released vLLM
#                    and SGLang wheels, each in an environment of its own under .engines/ (several
#                    GB, made on first use; tests/engines/suite.py)
# Extra arguments go to the job. The environment lives in .venv (VENV=... to move it).
set -euo pipefail
cd "$(dirname "$0")"
job="${1:-}"
shift || true
case "$job" in
  main|tests|engines) ;;
  *) echo "usage: ./run.sh main|tests|engines [args...]" >&2; exit 2 ;;
esac

venv="${VENV:-.venv}"
python="${PYTHON:-python3}"
say() { echo "run.sh: $*" >&2; }
if [ ! -x "$venv/bin/python" ]; then
  say "creating the environment in $venv"
  # Reuse a CUDA build of torch that the system Python already has (GPU images) instead of
  # downloading another one; otherwise the venv gets its own CPU build.
  if "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    "$python" -m venv --system-site-packages "$venv"
  else
    "$python" -m venv "$venv"
  fi
fi
py="$venv/bin/python"
if ! "$py" -c "import torch" 2>/dev/null; then
  say "installing torch 2.13.0 (CPU build, about 200 MB: a few minutes on a fresh machine)"
  "$py" -m pip install --quiet "torch==2.13.0"
fi
stamp="$venv/.installed-$(cat pyproject.toml setup.py alloc/_build.py $(find csrc -type f | sort) | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  say "installing indexer-arena, its tools and test dependencies, building the C core"
  "$py" -m pip install --quiet -e ".[test,torch,tools]"
  touch "$stamp"
fi

case "$job" in
  main) exec "$py" examples/seed_workload.py "$@" ;;
  tests) exec "$py" -m pytest -q "$@" ;;
  engines) exec "$py" -m tests.engines.suite "$@" ;;
esac
