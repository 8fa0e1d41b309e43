#!/usr/bin/env bash
# run.sh: runs every ebb benchmark, keeps their `bench=` lines, and prints one summary table.
# usage: perf/run.sh [--quick] [--out DIR] [bin_dir]
#   bin_dir   where the programs are (default: this script's directory if it holds them, else
#             build/default/bin; build them with `cmake --build --preset default`)
#   --quick   shorter runs (fewer rounds, iterations and sizes where the programs take them): a
#             smoke run, as CI's; its figures are not for publishing
#   --out DIR where the logs go (default: bin_dir/../perf-run, e.g. build/default/perf-run)
# Writes DIR/bench.log (every `bench=` line, in the order run, also echoed to stderr), DIR/stderr.log
# (the programs' diagnostics) and DIR/summary.md (the table, also printed on stdout): one row per
# figure that has a target or a peer, with ebb's figure, the peer's, the ratio, the target and
# whether it is met (perf/summary.py defines the rows; `perf/summary.py DIR/bench.log` prints the
# table again). A benchmark that needs a peer library not found at configure time (libtorch,
# oneDNN) or a tool that is missing (strace, python3-torch) shows as "not built" in its rows;
# a benchmark that fails makes the exit status 1 and its rows show "missing".
# The figures are for the driver ebb_init picks (EBB_DRIVER); perf/RESULTS.md records how each
# published figure was produced. Compute runs on one OpenBLAS thread where a peer is compared
# (OPENBLAS_NUM_THREADS=1), as the peers' programs set it for themselves.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
quick=0 out="" bin=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) quick=1 ;;
    --out) out="${2:?run.sh: --out needs a directory}"; shift ;;
    -h|--help) sed -n '2,20p' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) echo "run.sh: unknown option '$1' (run.sh --help)" >&2; exit 2 ;;
    *) bin="$1" ;;
  esac
  shift
done
if [[ -z $bin ]]; then
  if [[ -x "$here/ebb-bench-launch" ]]; then bin="$here"; else bin="$here/../build/default/bin"; fi
fi
bin="$(cd "$bin" && pwd)" || exit 2
out="${out:-$bin/../perf-run}"
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
log="$out/bench.log" err="$out/stderr.log"
: >"$log"
: >"$err"
# perf/ beside this script (the source tree) or beside the programs (the build copies the scripts)
perf="$here"
summary="$perf/summary.py"

# The emulated driver's perturbation mode (on in the test presets) adds random delays to every
# command: figures taken with it say nothing about ebb.
if [[ -n "${EBB_SIM_PERTURB:-}" && "${EBB_SIM_PERTURB}" != 0 ]]; then
  echo "run.sh: EBB_SIM_PERTURB=${EBB_SIM_PERTURB} adds random delays to emulated work; unset it for figures" >&2
fi
echo "run.sh: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)$([[ $quick -eq 1 ]] && echo ', --quick'); bench lines: $log" >&2

status=0
# One benchmark: $1 the `bench=` name it reports under when it is not built, then the command
# (run from bin/). Its `bench=` lines go to the log and stderr, everything else to stderr.log.
run() {
  local name="$1" t0=$SECONDS rc
  shift
  local prog="$1"
  if [[ $prog != */* ]]; then prog="$bin/$prog"; fi
  if [[ ! -x $prog ]]; then
    local why=not_built
    case "$name" in
      ops_peer|optim|engine) why=libtorch_not_found ;;  # built only where libtorch-dev is found
      dnnl) why=oneDNN_not_found ;;                    # only where libdnnl-dev is found
    esac
    echo "bench=$name skipped=$why" | tee -a "$log" >&2
    return
  fi
  echo "== $*" >>"$err"
  (cd "$bin" && "$prog" "${@:2}") >"$out/.run.out" 2>>"$err"
  rc=$?
  grep '^bench=' "$out/.run.out" | tee -a "$log" >&2
  if [[ $rc -ne 0 ]]; then
    echo "run.sh: $* failed (exit code $rc; its messages: $err)" >&2
    status=1
  fi
  echo "run.sh: $(basename "$prog") $((SECONDS - t0)) s" >&2
}
# `q QUICK_ARGS -- FULL_ARGS`: the arguments for this mode.
q() {
  local quick_args=() full_args=()
  while [[ $# -gt 0 && $1 != -- ]]; do quick_args+=("$1"); shift; done
  shift
  full_args=("$@")
  if [[ $quick -eq 1 ]]; then args=("${quick_args[@]}"); else args=("${full_args[@]}"); fi
}
args=()

# streams and launch
q 10000 1 --;                         run launch ebb-bench-launch "${args[@]}"
q 10000 1 --;                         run event ebb-bench-event "${args[@]}"
q 4194304 1 --;                       run copy ebb-bench-copy "${args[@]}"
q 2000 1000 --;                       run stream_churn ebb-bench-stream_churn "${args[@]}"
# memory
if [[ $quick -eq 1 ]]; then
  EBB_BENCH_REPLAYS=1 EBB_BENCH_SMALL_LIVE=1000 EBB_BENCH_SMALL_PAIRS=20000 run arena_fastpath ebb-bench-arena_fastpath
else
  run arena_fastpath ebb-bench-arena_fastpath
fi
q 2000 --;                            run pinned ebb-bench-pinned "${args[@]}"
q 20000 --;                           run host ebb-bench-host "${args[@]}"
q 1 --;                               run history ebb-bench-history "${args[@]}"
run frag "$perf/frag.sh" "$bin"
# system calls
q "$bin" 10000 -- "$bin";             run syscalls "$perf/syscalls.sh" "${args[@]}"
q "$bin" 2 5 -- "$bin" 10 5;          run train_syscalls "$perf/train_syscalls.sh" "${args[@]}"
# ops (OpenBLAS on one thread, as in the peers' programs)
export OPENBLAS_NUM_THREADS=1
q 1 1 -- 9 10;                        run ops_elementwise ebb-bench-ops_elementwise "${args[@]}"
q 1 1 256 -- 9 4;                     run ops_matmul ebb-bench-ops_matmul "${args[@]}"
q 1 1000 --;                          run ops_dispatch ebb-bench-ops_dispatch "${args[@]}"
q 1 1 --;                             run ops_reduce ebb-bench-ops_reduce "${args[@]}"
q 1 1 --;                             run ops_linear ebb-bench-ops_linear "${args[@]}"
q 0 1 1 256 -- 0 5 4 2048;            run ops_device ebb-bench-ops_device "${args[@]}"
q --rounds 1 --op softmax,add_1elem,mlp_small -- --rounds 7
run ops_peer ebb-bench-ops_peer "${args[@]}"
q --rounds 1 --op softmax_fwd -- --rounds 7; run dnnl ebb-bench-dnnl "${args[@]}"
# training building blocks
q 7 -- 9;                             run optim ebb-bench-optim "${args[@]}"
q 3 -- 15;                            run custom_function ebb-bench-custom_function "${args[@]}"
# the backward engine, ebb and libtorch taken in turn (as perf/engine_ratio.sh)
q 1 -- 7
for i in $([[ $quick -eq 1 ]] && echo 1 || echo 1 2 3); do
  run engine ebb-bench-engine "${args[@]}"
  if [[ -x $bin/ebb-bench-engine-torch ]]; then
    run engine ebb-bench-engine-torch "${args[@]}"
  elif [[ $i -eq 1 ]]; then
    echo "bench=engine impl=libtorch skipped=libtorch_not_found" | tee -a "$log" >&2
  fi
done
q 3 --;                               run engine_devices ebb-bench-engine_devices "${args[@]}"
# autograd: a custom op against the built-in op whose kernel and backward it reuses
q 3 1 1048576 --;                     run custom_op ebb-bench-custom_op "${args[@]}"
unset OPENBLAS_NUM_THREADS
# autograd: offloaded saved tensors (the programs set their own environment)
q 2 1 --;                             run offload ebb-bench-offload "${args[@]}"
q 2 1 --;                             run offload_budget ebb-bench-offload_budget "${args[@]}"
# distributed: the data-parallel reducer on 2 ranks under Open MPI, one emulated device each
mpirun_bin="$(command -v mpirun || echo /nonexistent/mpirun)"
q 2 512 16 3 -- 7 2048 16 10
EBB_SIM_DEVICES=1 run ddp "$mpirun_bin" --allow-run-as-root --oversubscribe -np 2 "$bin/ebb-bench-ddp" "${args[@]}"
# autograd: map against the explicit loop (the program sets its own environment)
q 1 1 --;                             run map ebb-bench-map "${args[@]}"
rm -f "$out/.run.out"

if ! python3 "$summary" "$log" >"$out/summary.md"; then
  echo "run.sh: $summary failed" >&2
  exit 1
fi
cat "$out/summary.md"
echo "run.sh: the table is also in $out/summary.md" >&2
exit $status
