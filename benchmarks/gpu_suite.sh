#!/usr/bin/env bash
# Everything GPU-side in one call on a bare machine: install the carried wheels, build the C core
# (both builds) and the out-of-memory shim for this machine's Python and torch, then run the stages asked for,
# writing logs and JSON to a work folder packed at the end into $OUT/results.tgz (default ./gpu-out):
# one file, whatever the number of stages.
#   benchmarks/gpu_suite.sh [setup] [tests-alloc] [tests-graphs] [tests-scoped] [tests-indexer] [alloc-bench] [alloc-memory] [decode-graphs] [indexer]
#                           [indexer-goals] [topk] [topk-check] [replay] [tp] [torch-tests] [memory-viz]
# (indexer-goals: the indexer benchmark without the config sweep, which compiles every
# candidate; pytest reads PYTEST_ADDOPTS, e.g. "-k hopper", to split the GPU tests; XDIST="-n 4"
# runs tests-graphs, tests-scoped and tests-indexer four at a time, then their device_wide tests
# alone; tests-alloc runs one test at a time whatever XDIST says)
# (topk-check: the top-k's GPU tests alone, both layouts; topk: its benchmark)
# (tp: the seed workload on min(2, GPUs) ranks through torch.distributed, benchmarks/alloc/tp_seed.py)
# (torch-tests: PyTorch's own graph and memory-tooling tests under both allocators,
# benchmarks/alloc/torch_tests.py; TORCH_TESTS names PyTorch's test/test_cuda.py, which is not
# part of this tree: default .torch-tests/test_cuda.py; TORCH_TESTS_ARGS: more of its flags, e.g.
# "-k REGEX --alone 4")
set -uo pipefail
cd "$(dirname "$0")/.."
DEST="${OUT:-gpu-out}"
OUT="$(mktemp -d)/results"
mkdir -p "$OUT" "$DEST"
trap 'tar -C "$(dirname "$OUT")" -czf "$DEST/results.tgz" results' EXIT
trap 'echo "=== stopped by SIGTERM"; exit 143' TERM  # a time limit still leaves the archive
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export INDEXER_ARENA_CACHE=/tmp/indexer-arena-cache
py=python3
pytest=($py -m pytest -q -rA -p no:cacheprovider)  # every stage's pytest
status=0

# pytest_stage NAME MARKERS FILES...: pytest over FILES for the tests MARKERS selects ("" for all),
# XDIST's processes side by side, then the tests marked device_wide one at a time with no other
# test process on the device (they read its free memory, which other processes move)
pytest_stage() {
  local name=$1 markers=$2; shift 2
  if [ -z "${XDIST:-}" ]; then
    step "$name" "${pytest[@]}" ${markers:+-m "$markers"} "$@"
    return
  fi
  step "$name" "${pytest[@]}" $XDIST -m "${markers:+($markers) and }not device_wide" "$@"
  step "${name}_alone" pytest_or_none -m "${markers:+($markers) and }device_wide" "$@"
}

pytest_or_none() {  # pytest, where selecting no test is not a failure (exit 5)
  "${pytest[@]}" "$@"
  local rc=$?
  [ $rc -eq 5 ] && rc=0
  return $rc
}

step() {  # step NAME COMMAND...: runs, logs to $OUT/NAME.log, remembers a failure
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" > >(tee "$OUT/$name.log") 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
}

setup() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  fi
  $py alloc/_build.py > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  # the test build (csrc/testing/ built in), which the tests load: once here, not in each worker
  $py -c "from tests.support.testing_core import ensure_built; ensure_built()" || exit 1
  $py -m alloc build-shim || exit 1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
  grep -hE "cudaDevAttr(Integrated|PageableMemoryAccess|ConcurrentManagedAccess|PageableMemoryAccessUsesHostPageTables) *=" \
    /usr/local/cuda/include/driver_types.h 2>/dev/null | head -4
  $py -m alloc devices
}

for stage in "${@:-setup tests-alloc alloc-bench}"; do
  case "$stage" in
    setup) setup ;;
    tests-alloc) step gpu_tests_alloc "${pytest[@]}" -m gpu \
                   tests/alloc/plugin/test_expandable.py ;;  # one process at a time: some fill the device
    tests-graphs) pytest_stage gpu_tests_graphs gpu tests/alloc/plugin/test_graphs.py tests/alloc/plugin/test_gpu.py \
                    tests/alloc/plugin/test_memory_stats.py tests/alloc/plugin/test_memory_tools.py ;;
    tests-scoped) pytest_stage gpu_tests_scoped "" \
                    tests/alloc/plugin/test_scoped.py tests/alloc/plugin/test_engine_gpu.py tests/alloc/test_engines.py tests/alloc/plugin/test_cpu.py \
                    tests/alloc/test_unified.py "tests/arena_tools/test_replay.py::test_gpu_side_by_side" \
                    "tests/indexer/test_prefill.py::test_prefill_same_indices_with_and_without_the_arena" ;;
    tests-indexer) pytest_stage gpu_tests_indexer gpu tests/indexer ;;
    alloc-bench)
      step seed_workload $py examples/seed_workload.py --json "$OUT/seed_workload.json"
      step torch_alloc $py benchmarks/alloc/bench_torch_alloc.py --json "$OUT/torch_alloc.json"
      step llama $py benchmarks/alloc/bench_llama.py --json "$OUT/llama.json"
      step arena_micro $py benchmarks/alloc/bench_arena.py --pairs 1000000 --repeats 5 --json "$OUT/arena_micro.json" ;;
    alloc-memory)  # the memory figures alone (seed workload, decode graphs), without alloc-bench's timing rows
      step seed_workload $py examples/seed_workload.py --json "$OUT/seed_workload.json"
      step decode_graphs $py benchmarks/alloc/bench_decode_graphs.py --json "$OUT/decode_graphs.json" ;;
    decode-graphs) step decode_graphs $py benchmarks/alloc/bench_decode_graphs.py --json "$OUT/decode_graphs.json" ;;
    indexer) step indexer_bench $py benchmarks/indexer/bench_indexer.py --json "$OUT/indexer.json" ;;
    indexer-goals) step indexer_goals $py benchmarks/indexer/bench_indexer.py --no-sweep \
                     --only ceilings,logits,topk,prefill --json "$OUT/indexer_goals.json" ;;
    topk) step topk_bench $py benchmarks/indexer/bench_topk.py --json "$OUT/topk.json" ;;
    topk-check) step topk_gpu_tests "${pytest[@]}" -m gpu tests/indexer/test_topk.py tests/indexer/test_topk_stream.py ;;
    tp) step tp_seed $py benchmarks/alloc/tp_seed.py --json "$OUT/tp_seed.json" --markdown "$OUT/tp_seed.md" ;;
    memory-viz) step memory_viz $py examples/memory_viz.py "$OUT/memory_viz" ;;
    torch-tests) step torch_tests $py benchmarks/alloc/torch_tests.py --tests "${TORCH_TESTS:-.torch-tests/test_cuda.py}" \
                   --jobs "${TORCH_TESTS_JOBS:-12}" --json "$OUT/torch_tests.json" --log "$OUT/torch_tests.jsonl" \
                   ${TORCH_TESTS_ARGS:-} ;;
    replay)
      step report_example $py examples/report_example.py "$OUT/report"
      step replay $py -m arena_tools replay "$OUT/report/trace.csv" --json "$OUT/replay.json" ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
exit $status
