#!/usr/bin/env bash
# frag.sh: replays every trace in perf/traces with ebb-alloc-replay, with and without expandable
# segments, and prints `bench=frag trace=<name> expandable=<0|1> <the tool's line>`. The traces are
# the synthetic *.trace (tools/gen-alloc-trace.py) and the real real_*.trace.gz, recorded from
# PyTorch training runs (tools/record-traces.py), which are replayed through `zcat | ... -`.
# usage: perf/frag.sh [bin_dir] [traces_dir]   (bin_dir: as run.sh; traces_dir: ./traces beside
#        this script, which the build copies next to the programs)
# Each trace is given as many streams as its highest stream index needs. Target: frag_ratio <= 1.10.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ $# -ge 1 ]]; then
  bin="$1"
elif [[ -x "$here/ebb-alloc-replay" ]]; then
  bin="$here"
else
  bin="$here/../build/default/bin"
fi
traces="${2:-$here/traces}"

shopt -s nullglob
files=("$traces"/*.trace "$traces"/*.trace.gz)
if [[ ${#files[@]} -eq 0 ]]; then
  echo "frag.sh: no *.trace or *.trace.gz files in $traces" >&2
  exit 1
fi

status=0
for f in "${files[@]}"; do
  name="$(basename "$f")"
  name="${name%.gz}"
  name="${name%.trace}"
  # A plain trace is named to the tool (its messages then name the file); a gzipped one is piped
  # (the tool reads all of its input before replaying, so zcat is never cut short).
  if [[ $f == *.gz ]]; then
    replay() { zcat "$f" | "$bin/ebb-alloc-replay" - "$@"; }
    text() { zcat "$f"; }
  else
    replay() { "$bin/ebb-alloc-replay" "$f" "$@"; }
    text() { cat "$f"; }
  fi
  # Streams needed: one more than the highest stream index of an `a` line (comments aside).
  streams="$(text | awk '$1 == "a" && $4 ~ /^[0-9]+$/ && $4 + 1 > n { n = $4 + 1 } END { print (n ? n : 1) }')"
  for x in 0 1; do
    args=(--streams "$streams")
    [[ $x -eq 1 ]] && args+=(--expandable)
    if line="$(replay "${args[@]}")"; then
      echo "bench=frag trace=$name expandable=$x $line"
    else
      echo "frag.sh: ebb-alloc-replay failed on $f (expandable=$x)" >&2
      status=1
    fi
  done
done
exit $status
