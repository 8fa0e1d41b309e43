"""check_summary.py: perf/summary.py turns `bench=` lines into the table perf/run.sh prints.

usage: check_summary.py PATH/TO/summary.py
Checks, on lines written here: a row met and a row with a gap (a target on ebb's figure and one on
the ratio), the ratio oriented so that above 1 means ebb is better for a time and for a rate, the
program's own ratio preferred, runs in turn paired, a peer that is not built ("not built
(libtorch not found)", never a failure), a benchmark that printed nothing ("missing"), rows split
by a key and rows folded over one (ranges and the gaps named), and lines that are not `bench=`
lines ignored.
"""
import subprocess
import sys

LINES = """\
run.sh: some diagnostic line
bench=history pair_ns_on=60 pair_ns_off=30 rounds=7
bench=history ns_per_alloc=30.0 dump_s_per_million=0.75
bench=engine graph=chain impl=ebb nodes=10 fwd_ns_per_node=1 bwd_ns_per_node=250 free_ns_per_node=1
bench=engine graph=chain impl=libtorch nodes=10 fwd_ns_per_node=1 bwd_ns_per_node=1000 free_ns_per_node=1
bench=engine graph=chain impl=ebb nodes=10 fwd_ns_per_node=1 bwd_ns_per_node=300 free_ns_per_node=1
bench=engine graph=chain impl=libtorch nodes=10 fwd_ns_per_node=1 bwd_ns_per_node=1200 free_ns_per_node=1
bench=engine graph=chain impl=ebb nodes=10 fwd_ns_per_node=1 bwd_ns_per_node=200 free_ns_per_node=1
bench=engine graph=chain impl=libtorch nodes=10 fwd_ns_per_node=1 bwd_ns_per_node=1400 free_ns_per_node=1
bench=ops_elementwise device=cpu gbps=4.0 memcpy_gbps=2.0 ratio=2.00
bench=ops_elementwise device=0 gbps=0.5 memcpy_gbps=2.0 ratio=0.25
bench=optim skipped=libtorch_not_found
bench=copy dir=h2d host=pinned bytes=1048576 gbps=1 memcpy_gbps=2 ratio=0.5
bench=copy dir=h2d host=pinned bytes=4194304 gbps=2 memcpy_gbps=2 ratio=1.0
bench=copy dir=h2d host=pinned bytes=4096 gbps=0.1 memcpy_gbps=2 ratio=0.05
bench=train_syscalls impl=ebb steps=10 mmap=0 munmap=0 brk=0 madvise=0 futex=40 total=40 per_step_total=4.0
bench=train_syscalls impl=torch skipped=no_torch
"""


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def row(table, start):
    rows = [r for r in table.splitlines() if r.startswith("| " + start)]
    if len(rows) != 1:
        fail(f"expected one row starting {start!r}, found {len(rows)}:\n{table}")
    return [c.strip() for c in rows[0].strip("|").split("|")]


def main():
    p = subprocess.run([sys.executable, sys.argv[1]], input=LINES, capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        fail(f"summary.py exited {p.returncode}:\n{p.stderr}")
    t = p.stdout
    if not t.startswith("| benchmark"):
        fail(f"the output is not a Markdown table:\n{t}")
    # targets on ebb's figure
    if row(t, "`history` `ns_per_alloc`")[5] != "met":
        fail("history ns_per_alloc 30 < 50 should be met")
    if row(t, "`history` `dump_s_per_million`")[5] != "**gap**":
        fail("history dump 0.75 s against < 0.5 s should be a gap")
    # times: peer / ebb, runs in turn paired (1000/250, 1200/300, 1400/200: median 4, not 1200/250)
    r = row(t, "`engine graph=chain`")
    if r[3] != "4" or r[5] != "**gap**" or "libtorch: 1200 ns" not in r[2] or r[1] != "250 ns":
        fail(f"engine chain row: {r}")
    # rates: the program's own ratio, split by device
    if row(t, "`ops_elementwise device=cpu`")[3] != "2" or row(t, "`ops_elementwise device=cpu`")[5] != "met":
        fail(f"ops_elementwise device=cpu: {row(t, '`ops_elementwise device=cpu`')}")
    if row(t, "`ops_elementwise device=0`")[5] != "**gap**":
        fail("ops_elementwise device=0 at 0.25 against >= 0.5 should be a gap")
    # a program that needs libtorch, not built: both cells say so, and it is no failure
    r = row(t, "`optim tensors=100`")
    if r[1] != "not built (libtorch not found)" or r[5] != "n.a.":
        fail(f"optim not built: {r}")
    if row(t, "`arena_fastpath dist=tensor`")[1] != "missing":
        fail("a benchmark with no line should read missing")
    # folded over the sizes from 1 MiB (4 KiB is not one of them): 1 of 2 met, the gap named
    r = row(t, "`copy dir=h2d host=pinned`")
    if r[1] != "1-2 GB/s over 2" or not r[5].startswith("met in 1 of 2") or "1 MiB (1, ratio 0.5)" not in r[5]:
        fail(f"copy row: {r}")
    r = row(t, "`train_syscalls` mmap+munmap+brk+madvise")
    if r[1] != "0" or r[2] != "skipped (no torch)" or r[5] != "met":
        fail(f"train_syscalls row: {r}")
    print("summary.py: targets, ratios, pairing, splits, folds, not built and missing rows as expected")
    print("ok")


if __name__ == "__main__":
    main()
