#!/usr/bin/env bash
# train_syscalls.sh: the system calls of a steady-state training step, ebb-train beside PyTorch.
# Runs `strace -f` on `ebb-train --steps W+N --quiet` (its defaults: the 8-layer MLP 64-512-...-10,
# batch 512, every emulated device, saved tensors offloaded) with EBB_TRAIN_SYSCALL_MARKERS=W, and
# counts, over all threads, the calls made between its steady-begin and steady-end markers: the N
# steps after W warm-up steps. Then the same for a CPU training step of the same MLP in Debian's
# python3-torch (perf/train_step_torch.py: AdamW, batch 512, one thread), whose markers are
# os.access calls. Prints per program
#   bench=train_syscalls impl=<ebb|torch> steps=N mmap=N munmap=N brk=N madvise=N futex=N total=N per_step_total=X
# (the counts are over the N steady steps; the per-step table of every call goes to stderr), or
# `impl=torch skipped=no_torch` where python3 has no torch. Target: no mmap, munmap, brk or madvise
# in ebb's steady state. Where ebb makes one, the script runs ebb-train again under `strace -k` and
# prints the stack of each such call to stderr (who makes it: ebb, the emulated driver, the
# process allocator).
# Both run their BLAS on one thread (OPENBLAS_NUM_THREADS=1, OMP_NUM_THREADS=1): with more, idle
# OpenBLAS threads spin on sched_yield (thousands of calls a step in PyTorch's run).
# Warm-up: ebb's device arenas reach their size within the first two steps. A step's demand
# repeats, and an allocation that only frees still pending on other streams (the offload copies,
# the gradients' cross-device copies) could hold waits for them instead of growing the arena
# (include/ebb/alloc.h, pending_wait_us). Without that wait (EBB_ALLOC_CONF=pending_wait_us:0)
# a copy running late, as on a loaded host, grew an arena by a granule in any step now and then
# (the emulated driver's cuMemMap and cuMemSetAccess: an mmap and an madvise each). 5 warm-up
# steps by default, a margin over the two.
# usage: perf/train_syscalls.sh [bin_dir] [steady_steps (default 10)] [warmup_steps (default 5)]
#        (bin_dir: where ebb-train is; default: this script's directory if it holds it, else
#        build/default/bin). EBB_SIM_DEVICES (default 2) sets the emulated devices; EBB_TORCH_PYTHON
#        (default /usr/bin/python3, Debian's, whose python3-torch is the peer) the python that runs it.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ $# -ge 1 && -n $1 ]]; then
  bin="$(cd "$1" && pwd)"
elif [[ -x "$here/ebb-train" ]]; then
  bin="$here"
else
  bin="$here/../build/default/bin"
fi
steps="${2:-10}"
warmup="${3:-5}"
train="$bin/ebb-train"
torch_script="$here/train_step_torch.py"
python="${EBB_TORCH_PYTHON:-/usr/bin/python3}"

if ! command -v strace >/dev/null 2>&1; then
  echo "bench=train_syscalls skipped=no_strace"
  exit 0
fi
if [[ ! -x "$train" ]]; then
  echo "train_syscalls.sh: $train not found (build with: cmake --build --preset default)" >&2
  exit 1
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# Counts the calls of strace log $1 between the markers named $2 (a fixed string before
# ":steady-begin" / ":steady-end"): "name count" lines, most frequent first. Lines look like
# "PID name(args) = ret", or "PID name(args <unfinished ...>" followed later by
# "PID <... name resumed>...": each call counts once, at its start.
count_between() {
  awk -v tag="$2" '
    index($0, tag ":steady-begin") { inside = 1; next }
    index($0, tag ":steady-end")   { inside = 0; next }
    inside && match($0, /^[0-9]+ +[a-z_0-9]+\(/) {
      name = substr($0, RSTART, RLENGTH - 1); sub(/^[0-9]+ +/, "", name); n[name]++
    }
    END { for (k in n) print k, n[k] }
  ' "$1" | sort -k2,2nr -k1,1
}

# Prints the bench= line of impl $1 from the counts in $2; the per-step table to stderr.
report() {
  local impl="$1" counts="$2" line total=0 name c
  {
    echo "train_syscalls.sh: impl=$impl: calls per steady step ($steps steps after $warmup warm-up steps), all threads:"
    awk -v n="$steps" '{ printf "  %-24s %10.1f\n", $1, $2 / n }' "$counts"
  } >&2
  while read -r name c; do total=$((total + c)); done <"$counts"
  line="bench=train_syscalls impl=$impl steps=$steps"
  for name in mmap munmap brk madvise futex; do
    c=$(awk -v n="$name" '$1 == n { print $2 }' "$counts")
    line+=" $name=${c:-0}"
  done
  echo "$line total=$total per_step_total=$(awk -v t="$total" -v n="$steps" 'BEGIN { printf "%.1f", t / n }')"
}

export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1

# ---- ebb-train ----
export EBB_SIM_DEVICES="${EBB_SIM_DEVICES:-2}"
run_ebb() { # $@: strace options before the program
  (cd "$tmp" && EBB_TRAIN_SYSCALL_MARKERS="$warmup" strace -f -qq "$@" \
     "$train" --steps $((warmup + steps)) --quiet >"$tmp/ebb.out" 2>"$tmp/ebb.err")
}
if ! run_ebb -o "$tmp/ebb.trace"; then
  if grep -qi "ptrace" "$tmp/ebb.err"; then
    echo "bench=train_syscalls skipped=ptrace_not_permitted"
    exit 0
  fi
  cat "$tmp/ebb.err" >&2
  exit 1
fi
if ! grep -q "ebb-train:steady-end" "$tmp/ebb.trace"; then
  echo "train_syscalls.sh: ebb-train's steady-state markers are missing from strace's log" >&2
  exit 1
fi
echo "train_syscalls.sh: ebb-train: $(tail -n 1 "$tmp/ebb.out")" >&2
count_between "$tmp/ebb.trace" "ebb-train" >"$tmp/ebb.counts"
report ebb "$tmp/ebb.counts"

# Who makes the memory calls ebb's steady state should not make: the calls themselves, then
# their stacks from a second run under strace -k (where that run makes them too: they come with
# new peaks of the arenas' demand, which depend on timing).
memcalls='^[0-9]+ +(mmap|munmap|brk|madvise)[(]'
if awk '$1 ~ /^(mmap|munmap|brk|madvise)$/ { found = 1 } END { exit !found }' "$tmp/ebb.counts"; then
  {
    echo "train_syscalls.sh: ebb-train's steady-state mmap/munmap/brk/madvise calls:"
    awk 'index($0, "ebb-train:steady-begin") { inside = 1; next }
         index($0, "ebb-train:steady-end") { inside = 0 } inside' "$tmp/ebb.trace" | grep -E "$memcalls" | sed 's/^/  /'
  } >&2
  if run_ebb -k -e trace=mmap,munmap,brk,madvise,access -o "$tmp/ebb.stacks"; then
    awk -v re="$memcalls" '
      index($0, "ebb-train:steady-begin") { inside = 1; next }
      index($0, "ebb-train:steady-end")   { inside = 0; next }
      inside && /^[0-9]+ / { show = ($0 ~ re) }
      inside && show { print "  " $0 }
    ' "$tmp/ebb.stacks" >"$tmp/ebb.stacks.steady"
    if [[ -s "$tmp/ebb.stacks.steady" ]]; then
      echo "train_syscalls.sh: their stacks, from a second run under strace -k:" >&2
      cat "$tmp/ebb.stacks.steady" >&2
    else
      echo "train_syscalls.sh: a second run under strace -k made none in its steady state (they depend on timing)" >&2
    fi
  fi
fi

# ---- PyTorch ----
if ! "$python" -c 'import torch' >/dev/null 2>&1; then
  echo "bench=train_syscalls impl=torch skipped=no_torch"
  exit 0
fi
if ! strace -f -qq -o "$tmp/torch.trace" "$python" "$torch_script" "$steps" "$warmup" >"$tmp/torch.out" 2>"$tmp/torch.err"; then
  cat "$tmp/torch.err" >&2
  exit 1
fi
echo "train_syscalls.sh: torch $("$python" -c 'import torch; print(torch.__version__)'): $(tail -n 1 "$tmp/torch.out")" >&2
count_between "$tmp/torch.trace" "torch-train" >"$tmp/torch.counts"
report torch "$tmp/torch.counts"
