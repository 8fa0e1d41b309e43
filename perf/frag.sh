#!/usr/bin/env bash
# frag.sh: replays every trace in perf/traces with ebb-alloc-replay, with and without expandable
# segments, and prints `bench=frag trace=<name> expandable=<0|1> <the tool's line>`.
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
files=("$traces"/*.trace)
if [[ ${#files[@]} -eq 0 ]]; then
  echo "frag.sh: no *.trace files in $traces" >&2
  exit 1
fi

status=0
for f in "${files[@]}"; do
  name="$(basename "$f" .trace)"
  # Streams needed: one more than the highest stream index of an `a` line (comments aside).
  streams="$(awk '$1 == "a" && $4 ~ /^[0-9]+$/ && $4 + 1 > n { n = $4 + 1 } END { print (n ? n : 1) }' "$f")"
  for x in 0 1; do
    args=("$f" --streams "$streams")
    [[ $x -eq 1 ]] && args+=(--expandable)
    if line="$("$bin/ebb-alloc-replay" "${args[@]}")"; then
      echo "bench=frag trace=$name expandable=$x $line"
    else
      echo "frag.sh: ebb-alloc-replay failed on $f (expandable=$x)" >&2
      status=1
    fi
  done
done
exit $status
