#!/usr/bin/env bash
# frag.sh: replays every trace in perf/traces with ebb-alloc-replay, with and without expandable
# segments, and the same trace in the same mode with ebb-frag-reference (PyTorch's caching-allocator
# policy), and prints `bench=frag trace=<name> expandable=<0|1> <ebb's line> ref_peak_reserved=B
# ref_frag_ratio=R ref_driver_allocs=N`. The traces are the synthetic *.trace
# (tools/gen-alloc-trace.py) and the real real_*.trace.gz recorded from PyTorch training runs
# (tools/record-traces.py), read through gzip -dc. expandable=0 replays with classic segments
# (--classic), expandable=1 with expandable segments (the default where the driver has VMM);
# with expandable=1 the reference's variant with 2 MiB large-pool pages follows as ref2m_*, then
# plain best fit growing by 2 MiB granules (ebb-frag-reference --best-fit: one pool, the free end
# block measured by its size) as bf2m_*.
# usage: perf/frag.sh [bin_dir] [traces_dir]   (bin_dir: as run.sh; traces_dir: ./traces beside
#        this script, which the build copies next to the programs)
# Each trace is given as many streams as its highest stream index needs. Targets on the real
# traces: frag_ratio no worse than ref_frag_ratio in the same mode; in the default mode
# (expandable=1), peak_reserved at most bf2m_peak_reserved + 2 MiB, and frag_ratio <= 1.05
# wherever bf2m_frag_ratio is.
# The real traces in three sets: real_cnn, real_gpt_varlen, real_lstm, real_mlp and
# real_transformer chose the placement; real_accum, real_finetune, real_gru_packed, real_resnet and
# real_unet were held out from that choice but seen before the present placement was; held out
# (fresh), recorded after it and never used to choose: real_moe, real_seq2seq, real_tcn, real_vae
# and real_vit.
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
# The trace's text on stdout, whether gzipped or not.
trace_text() { if [[ $1 == *.gz ]]; then gzip -dc "$1"; else cat "$1"; fi; }

status=0
for f in "${files[@]}"; do
  name="$(basename "${f%.gz}" .trace)"
  # Streams needed: one more than the highest stream index of an `a` line (comments aside).
  streams="$(trace_text "$f" | awk '$1 == "a" && $4 ~ /^[0-9]+$/ && $4 + 1 > n { n = $4 + 1 } END { print (n ? n : 1) }')"
  for x in 0 1; do
    mode=(--classic) refmode=()
    [[ $x -eq 1 ]] && mode=(--expandable) refmode=(--expandable)
    if line="$(trace_text "$f" | "$bin/ebb-alloc-replay" - --streams "$streams" "${mode[@]}")"; then
      # The reference's figures, renamed ref_*; its failure leaves ebb's line without them.
      # Expandable: also its variant with 2 MiB large-pool pages (ref2m_*), the granule ebb
      # grows by.
      ref="$(trace_text "$f" | "$bin/ebb-frag-reference" - "${refmode[@]}" |
             sed -n 's/.*\(peak_reserved=[0-9]*\).*\(frag_ratio=[0-9.]*\).*\(driver_allocs=[0-9]*\).*/ ref_\1 ref_\2 ref_\3/p')" ||
        true
      [[ -n $ref ]] || { echo "frag.sh: ebb-frag-reference failed on $f (expandable=$x)" >&2; status=1; }
      if [[ $x -eq 1 ]]; then
        ref2="$(trace_text "$f" | "$bin/ebb-frag-reference" - --expandable --large-page 2097152 |
                sed -n 's/.*\(peak_reserved=[0-9]*\).*\(frag_ratio=[0-9.]*\).*\(driver_allocs=[0-9]*\).*/ ref2m_\1 ref2m_\2 ref2m_\3/p')" ||
          true
        [[ -n $ref2 ]] || { echo "frag.sh: ebb-frag-reference --large-page failed on $f" >&2; status=1; }
        bf="$(trace_text "$f" | "$bin/ebb-frag-reference" - --best-fit |
              sed -n 's/.*\(peak_reserved=[0-9]*\).*\(frag_ratio=[0-9.]*\).*\(driver_allocs=[0-9]*\).*/ bf2m_\1 bf2m_\2 bf2m_\3/p')" ||
          true
        [[ -n $bf ]] || { echo "frag.sh: ebb-frag-reference --best-fit failed on $f" >&2; status=1; }
        ref+="$ref2$bf"
      fi
      echo "bench=frag trace=$name expandable=$x $line$ref"
    else
      echo "frag.sh: ebb-alloc-replay failed on $f (expandable=$x)" >&2
      status=1
    fi
  done
done
exit $status
