#!/usr/bin/env bash
# syscalls.sh: the system calls ebb's warm hot path makes, counted with strace.
# Runs ebb-bench-syscalls under `strace -f` and counts, over all threads, the calls made between
# its loop-begin and loop-end markers, for two workloads: work=stream (launch + event record +
# stream wait, then the final synchronize) and work=memory (device arena, host pool, pinned pool
# and the program's own malloc, see bench_syscalls.c), each with the program linked to jemalloc
# (ebb's programs) and to glibc's malloc (ebb-bench-syscalls-glibc). Prints per run
#   bench=syscalls work=<stream|memory> malloc=<jemalloc|glibc> iters=N mmap=N munmap=N brk=N madvise=N futex=N total=N
# Target: mmap, munmap, brk and madvise 0 (nothing allocates from the OS once warm); futex only
# where a thread parks. The loop's whole table goes to stderr. (Markers rather than the
# difference of two `strace -c` runs: that difference is dominated by run-to-run noise.) To see
# who makes a call: strace -f -k -o log ebb-bench-syscalls, then read log between the markers.
# usage: perf/syscalls.sh [bin_dir] [iters]     (bin_dir: where ebb-bench-syscalls is; default:
#        this script's directory if it holds the program, else build/default/bin)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ $# -ge 1 ]]; then
  bin="$1"
elif [[ -x "$here/ebb-bench-syscalls" ]]; then
  bin="$here"
else
  bin="$here/../build/default/bin"
fi
iters="${2:-100000}"
prog="$bin/ebb-bench-syscalls"

if ! command -v strace >/dev/null 2>&1; then
  echo "bench=syscalls skipped=no_strace"
  exit 0
fi
if [[ ! -x "$prog" ]]; then
  echo "syscalls.sh: $prog not found (build with: cmake --build --preset default)" >&2
  exit 1
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# One run: $1 program, $2 work. Prints the bench= line; the call table goes to stderr.
count() {
  local p="$1" work="$2" malloc=glibc
  if readelf -d "$p" 2>/dev/null | grep -q 'libjemalloc'; then malloc=jemalloc; fi
  if ! strace -f -qq -o "$tmp/trace.txt" "$p" --iters "$iters" --work "$work" 2>"$tmp/err.txt"; then
    if grep -qi "ptrace" "$tmp/err.txt"; then
      echo "bench=syscalls skipped=ptrace_not_permitted"
      exit 0
    fi
    cat "$tmp/err.txt" >&2
    exit 1
  fi
  # Lines look like "PID name(args) = ret", or "PID name(args <unfinished ...>" followed later
  # by "PID <... name resumed>...": count each call once, at its start, between the markers.
  awk '
    /ebb-bench-syscalls:loop-begin/ { inside = 1; next }
    /ebb-bench-syscalls:loop-end/   { inside = 0; next }
    inside && match($0, /^[0-9]+ +[a-z_0-9]+\(/) {
      name = substr($0, RSTART, RLENGTH - 1); sub(/^[0-9]+ +/, "", name); n[name]++
    }
    END { for (k in n) print k, n[k] }
  ' "$tmp/trace.txt" | sort -k2,2nr >"$tmp/counts.txt"
  if ! grep -q "ebb-bench-syscalls:loop-end" "$tmp/trace.txt"; then
    echo "syscalls.sh: the loop markers are missing from strace's log" >&2
    exit 1
  fi
  {
    echo "syscalls.sh: $(basename "$p") work=$work: calls between the loop markers ($iters iterations), all threads:"
    sed 's/^/  /' "$tmp/counts.txt"
  } >&2
  local line="bench=syscalls work=$work malloc=$malloc iters=$iters" total=0 name c
  while read -r name c; do total=$((total + c)); done <"$tmp/counts.txt"
  for name in mmap munmap brk madvise futex; do
    c=$(awk -v n="$name" '$1 == n { print $2 }' "$tmp/counts.txt")
    line+=" $name=${c:-0}"
  done
  echo "$line total=$total"
}

for work in stream memory; do
  count "$prog" "$work"
  if [[ -x "$bin/ebb-bench-syscalls-glibc" ]]; then count "$bin/ebb-bench-syscalls-glibc" "$work"; fi
done
