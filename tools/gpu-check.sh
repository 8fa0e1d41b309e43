#!/usr/bin/env bash
# tools/gpu-check.sh [builddir]: ebb on a real GPU, in one command, within 10 minutes.
#
# 1. builds ebb (RelWithDebInfo, all cores, CUDA kernels when nvcc is there) into builddir
#    (default build/gpu), unless builddir already holds a build (then it only rebuilds what
#    changed, or uses it as it is when cmake is not installed) or was unpacked from
#    tools/gpu-pack.sh (a PACKED file: used as it is, with its own libraries);
# 2. asks ebb-info, with EBB_DRIVER=cuda, whether libcuda answers: exits 2 when no GPU does;
# 3. runs the whole test suite against libcuda (EBB_DRIVER=cuda; tests of the emulated driver's
#    own behaviour, such as fault injection, select it themselves; a packed build skips, saying so,
#    the tests that compile in the build tree and, without MPI, dist.mpi_missing): a failure is either ebb
#    meeting a real GPU or a test that assumes the emulated driver, both worth a look;
# 4. runs the op benchmarks on device 0: ebb-bench-ops_device (bandwidth of elementwise ops and
#    reductions against the device's peak, matmul TFLOP/s) and ebb-bench-ops_elementwise (the
#    add on the device against host memcpy);
# 5. with an MPI build and mpirun: ebb-bench-ddp on 2 ranks sharing device 0 over MPI, then NCCL
#    on one rank (dist_ranks, ddp_ranks, ebb-bench-ddp);
# 6. prints one summary: the GPU, the driver, the tests passed and failed (with the failures'
#    names and the first lines of their output), the benchmark and distributed lines.
# Everything goes to builddir/gpu-check/ (ctest.log, bench.log, dist.log, summary.txt) as well.
# Exit status: 0 when every test passed, 1 when some failed or a step broke, 2 without a GPU.
set -uo pipefail

B=${1:-build/gpu}
[[ $B == /* ]] || B=$PWD/$B # a relative builddir is the caller's, not the repository's
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[[ $# -ge 1 ]] || B=$PWD/build/gpu
OUT=$B/gpu-check
start=$SECONDS
jobs=$(nproc 2>/dev/null || echo 4)
# The suite shares one real GPU: many contexts at once would add out-of-memory and timing noise.
test_jobs=${GPU_CHECK_TEST_JOBS:-$((jobs < 4 ? jobs : 4))}
suite_s=${GPU_CHECK_SUITE_S:-300} # the whole suite's limit, for a lease with little time left
step() { printf '\n== gpu-check: %s  [%ds]\n' "$1" $((SECONDS - start)); }

mkdir -p "$OUT" || exit 1
status=0
skip=() # ctest arguments that leave tests out, each said when added; excl: names to exclude (-E)
excl=()

step "build ($B, $jobs jobs)"
if [[ -f $B/PACKED ]]; then
  # A build from tools/gpu-pack.sh: used as it is (this machine may lack ebb's dependencies).
  # Its CTest files and run paths name the directory it was built in: link that to this one.
  cat "$B/PACKED"
  src=$(sed -n 's/^source=//p' "$B/PACKED")
  if [[ $src != "$PWD" ]]; then
    if [[ -e $src && ! $src -ef $PWD ]]; then
      echo "gpu-check: the packed build names $src, which exists here and is not this repository"; exit 1
    fi
    [[ -e $src ]] || { mkdir -p "$(dirname "$src")" && ln -s "$PWD" "$src"; } || exit 1
  fi
  # The tests run some programs (cmake, python3) by the absolute path of the packing machine:
  # where that path is missing here, the CTest files get this machine's program of that name.
  for p in $(sed -n 's/^programs=//p' "$B/PACKED"); do
    [[ -x $p ]] && continue
    here=$(command -v "${p##*/}") || {
      echo "gpu-check: no ${p##*/} here; tests that run $p will not run"
      # the browser case of ebb-train fails, by design, where chromium is missing: not a finding here
      [[ ${p##*/} == chromium* ]] && excl+=('^tools\.train_browser$') && echo "gpu-check: tools.train_browser is not run"
      continue
    }
    find "$B" -name "*.cmake" -exec sed -i "s|$p|$here|g" {} +
    echo "gpu-check: tests run $here for $p"
  done
  export LD_LIBRARY_PATH=$B/deplib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
elif command -v cmake >/dev/null; then
  if [[ ! -f $B/CMakeCache.txt ]]; then
    cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$OUT/configure.log" 2>&1 ||
      { tail -30 "$OUT/configure.log"; echo "gpu-check: configure failed ($OUT/configure.log)"; exit 1; }
  fi
  grep -E "ebb: (CUDA kernels|nvcc or cuda.h|CUDA headers|no CUDA headers)" "$OUT/configure.log" 2>/dev/null
  timeout 240 cmake --build "$B" -j "$jobs" >"$OUT/build.log" 2>&1 ||
    { tail -30 "$OUT/build.log"; echo "gpu-check: build failed or took over 240 s ($OUT/build.log)"; exit 1; }
elif [[ ! -x $B/bin/ebb-info ]]; then
  echo "gpu-check: no cmake here and no build in $B: build elsewhere and bring $B along"
  exit 1
fi
bin=$B/bin

step "ebb-info (EBB_DRIVER=cuda)"
if ! EBB_DRIVER=cuda "$bin/ebb-info" >"$OUT/ebb-info.txt" 2>&1; then
  cat "$OUT/ebb-info.txt"
  echo "gpu-check: no GPU answers (ebb-info with EBB_DRIVER=cuda failed): nothing to check"
  exit 2
fi
cat "$OUT/ebb-info.txt"

step "test suite against libcuda"
if ! command -v ctest >/dev/null; then
  echo "gpu-check: no ctest here (it comes with cmake): the suite was not run" | tee "$OUT/ctest.log"
  status=1
fi
# A packed build leaves out what it cannot run, and says so: tests that build in the build tree
# (label build_tree: the tree is not packed, nor ebb's dependencies to compile with) and, when it
# was packed without MPI (tools/gpu-pack.sh configures it so), dist.mpi_missing, whose failure
# only says that.
if [[ -f $B/PACKED ]]; then
  skip+=(-LE build_tree)
  echo "gpu-check: packed build: tests labelled build_tree are not run (they compile in the build tree)"
  if ! grep -q '^mpi=on' "$B/PACKED"; then
    excl+=('^dist\.mpi_missing$')
    echo "gpu-check: packed without MPI: dist.mpi_missing is not run"
  fi
fi
[[ ${#excl[@]} -gt 0 ]] && skip+=(-E "$(IFS='|'; echo "${excl[*]}")")
# each test gets 120 s; the whole suite at most 300 s (GPU_CHECK_SUITE_S; a hang on a GPU is a
# finding, not a stall); GPU_CHECK_TEST_JOBS tests at once (default 4)
ctest_rc=1
command -v ctest >/dev/null && { EBB_DRIVER=cuda timeout "$suite_s" ctest --test-dir "$B" -j "$test_jobs" --timeout 120 \
  "${skip[@]}" --output-on-failure >"$OUT/ctest.log" 2>&1; ctest_rc=$?; }
[[ $ctest_rc -eq 0 ]] || status=1
[[ $ctest_rc -eq 124 ]] && echo "gpu-check: the suite ran past $suite_s s and was stopped" | tee -a "$OUT/ctest.log"
grep -E "tests passed|tests failed" "$OUT/ctest.log" | tail -1

step "op benchmarks on device 0"
{
  EBB_DRIVER=cuda timeout 90 "$bin/ebb-bench-ops_device" 0 7 10 4096 || echo "ebb-bench-ops_device: exit $?"
  EBB_DRIVER=cuda timeout 30 "$bin/ebb-bench-ops_elementwise" 5 20 || echo "ebb-bench-ops_elementwise: exit $?"
} >"$OUT/bench.log" 2>&1
cat "$OUT/bench.log"

# The distributed paths on the GPU, where ebb was built with MPI and mpirun is here: the reducer's
# benchmark on 2 ranks sharing device 0 over MPI (staged through pinned memory; the real GPU's
# compute against the collectives), then NCCL on one rank: collectives, stream order, the
# reducer's gradients and its benchmark. A machine with several GPUs gives each rank its own.
step "distributed on device 0 (MPI: 2 ranks; NCCL: 1 rank)"
: >"$OUT/dist.log"
if [[ -x $bin/ddp_ranks ]] && command -v mpirun >/dev/null; then
  M="mpirun --allow-run-as-root --oversubscribe"
  {
    EBB_DRIVER=cuda timeout 120 $M -np 2 "$bin/ebb-bench-ddp" || echo "ebb-bench-ddp (mpi, 2 ranks): exit $?"
    for m in collectives streams; do
      EBB_DRIVER=cuda EBB_TEST_DIST_BACKEND=nccl timeout 60 $M -np 1 "$bin/dist_ranks" $m || echo "dist_ranks $m (nccl): exit $?"
    done
    EBB_DRIVER=cuda EBB_TEST_DIST_BACKEND=nccl timeout 60 $M -np 1 "$bin/ddp_ranks" grads || echo "ddp_ranks grads (nccl): exit $?"
    EBB_DRIVER=cuda BENCH_DDP_BACKEND=nccl timeout 120 $M -np 1 "$bin/ebb-bench-ddp" || echo "ebb-bench-ddp (nccl, 1 rank): exit $?"
  } >"$OUT/dist.log" 2>&1
  grep -E "^bench=|passed|FAIL|exit [0-9]" "$OUT/dist.log"
else
  echo "gpu-check: no MPI build or no mpirun here: the distributed paths were not run" | tee "$OUT/dist.log"
fi

step "summary"
{
  echo "gpu-check $(date -u +%Y-%m-%dT%H:%MZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  grep -E "^device 0:|^  (kind|memory|compute|multiprocessors|memory bandwidth):|^  chosen:" "$OUT/ebb-info.txt"
  grep -E "tests passed|tests failed" "$OUT/ctest.log" | tail -1
  if grep -q "The following tests FAILED" "$OUT/ctest.log"; then
    sed -n '/The following tests FAILED/,$p' "$OUT/ctest.log" | head -60
    echo "first failure output:"
    grep -m1 -B2 -A25 -E "\*\*\*Failed|\*\*\*Exception|\*\*\*Timeout" "$OUT/ctest.log" | head -40
  fi
  grep -E "^bench=" "$OUT/bench.log"
  grep -vE "^bench=" "$OUT/bench.log" | head -10
  grep -E "^bench=|passed|FAIL|exit [0-9]|not run" "$OUT/dist.log" | head -20
  echo "elapsed ${SECONDS}s; logs in $OUT"
} | tee "$OUT/summary.txt"
exit $status
