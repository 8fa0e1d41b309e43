#!/bin/bash
# perf/engine_ratio.sh [reps] [builddir]: ebb-bench-engine and its libtorch peer, run in turn three
# times (so both see the same load), and per graph the backward ratio ebb/libtorch of each pair,
# their median, and the median ns per node of each. On a shared machine compare ratios, not ns.
set -euo pipefail
b=${2:-build/default}/bin
for i in 1 2 3; do
  "$b/ebb-bench-engine" "${1:-5}"; "$b/ebb-bench-engine-torch" "${1:-5}"
done | python3 -c '
import sys,re,statistics as S
d={}
for l in sys.stdin:
  kv=dict(x.split("=") for x in l.split())
  d.setdefault((kv["graph"],kv["impl"]),[]).append((float(kv["bwd_ns_per_node"]),float(kv["fwd_ns_per_node"]),float(kv["free_ns_per_node"])))
for g in ["chain","wide","tree","reuse","tree_grad_1","tree_grad_64","tree_grad_512"]:
  e=d[(g,"ebb")]; t=d[(g,"libtorch")]
  r=[a[0]/b[0] for a,b in zip(e,t)]
  print(g, "bwd ebb/libtorch ratios", ["%.3f"%x for x in r], "median %.3f"%S.median(r), "ebb bwd %.0f torch bwd %.0f"%(S.median([x[0] for x in e]),S.median([x[0] for x in t])))
'
