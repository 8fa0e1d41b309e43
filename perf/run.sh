#!/usr/bin/env bash
# run.sh: runs every ebb benchmark and prints their `bench=` lines (diagnostics go to stderr).
# usage: perf/run.sh [bin_dir]   (default: this script's directory if it holds the programs,
#        else build/default/bin; build them with `cmake --build --preset default`)
# The figures are for the driver ebb_init picks (EBB_DRIVER); perf/RESULTS.md records how each
# published figure was produced.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ $# -ge 1 ]]; then
  bin="$1"
elif [[ -x "$here/ebb-bench-launch" ]]; then
  bin="$here"
else
  bin="$here/../build/default/bin"
fi

# The emulated driver's perturbation mode (on in the test presets) adds random delays to every
# command: figures taken with it say nothing about ebb.
if [[ -n "${EBB_SIM_PERTURB:-}" && "${EBB_SIM_PERTURB}" != 0 ]]; then
  echo "run.sh: EBB_SIM_PERTURB=${EBB_SIM_PERTURB} adds random delays to emulated work; unset it for figures" >&2
fi

status=0
for b in launch event copy arena_fastpath pinned host stream_churn ops_elementwise ops_matmul ops_dispatch ops_reduce engine_devices offload offload_budget; do
  if ! "$bin/ebb-bench-$b" | grep '^bench='; then
    echo "run.sh: ebb-bench-$b failed" >&2
    status=1
  fi
done
# Benchmarks against libtorch, built only where libtorch-dev is installed.
for b in optim; do
  if [[ -x "$bin/ebb-bench-$b" ]]; then
    if ! OPENBLAS_NUM_THREADS=1 "$bin/ebb-bench-$b" | grep '^bench='; then
      echo "run.sh: ebb-bench-$b failed" >&2
      status=1
    fi
  else
    echo "run.sh: ebb-bench-$b not built (libtorch not found): skipped" >&2
  fi
done
if ! "$here/syscalls.sh" "$bin"; then
  echo "run.sh: syscalls.sh failed" >&2
  status=1
fi
if ! "$here/frag.sh" "$bin"; then
  echo "run.sh: frag.sh failed" >&2
  status=1
fi
exit $status
