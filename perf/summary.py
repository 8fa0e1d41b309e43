#!/usr/bin/env python3
"""summary.py: one Markdown table from the `bench=` lines of ebb's benchmarks (perf/run.sh).

usage: perf/summary.py [LOG ...]   (default: stdin; lines without `bench=` are ignored)

Each row is one figure that has a target or a peer: ebb's figure, the peer's, the ratio, the
target (and the issue that set it, as perf/RESULTS.md gives them) and whether it is met. The rows
are defined in ROWS below, the one place that says where each figure comes from:

  ebb, peer  a selector: the benchmark's name, key=value filters the line must match, and the key
             whose value is the figure ("a+b" sums keys; a value equal to `unknown` counts as
             none). A filter value may be a list (any of them) or a glob ("real_*"). A filter
             whose value is "*" splits the row into one row per value seen in ebb's lines; the
             keys in the row's `collapse` are enumerated too, but fold into one row that gives
             the ranges and names the values where the target is missed. Several lines matching
             one row (runs taken in turn, or several implementations) are folded by `agg`: the
             median by default, or "min" (the best of several peers) or "max".
  ratio      always oriented so that above 1 means ebb is better: for a time or a size (`lower`
             is better, the default) the peer's figure over ebb's; for a rate (`higher=True`)
             ebb's over the peer's. Where the program prints its own ratio in that orientation
             (a median of per-round ratios), `ratio_key` names it; else, where ebb and the peer
             have as many lines (runs in turn), the median of the pairwise ratios; else the
             ratio of the two figures.
  target     a check on the figures (ebb, peer, ratio) with its text; None where the row has only
             a peer. The check may return None: the target does not apply (then "n.a.").

A selector that finds no line: "not built" where the benchmark printed `skipped=` (a peer that
needs libtorch, strace or python3-torch), "missing" otherwise (the benchmark failed or was not
run); the row is then neither met nor a gap.
"""
import fnmatch
import math
import statistics
import sys

MIB = 1 << 20


class Sel:
    def __init__(self, bench, key, agg="median", unknown=None, **filters):
        self.bench, self.key, self.agg, self.unknown, self.filters = bench, key, agg, unknown, filters


class Target:
    def __init__(self, text, check):
        self.text, self.check = text, check


def ratio_at_least(x, text):
    return Target(text, lambda e, p, r: None if r is None else r >= x)


def ebb_at_most(x, text):
    return Target(text, lambda e, p, r: e <= x)


def ebb_below(x, text):
    return Target(text, lambda e, p, r: e < x)


def ebb_between(lo, hi, text):
    return Target(text, lambda e, p, r: lo <= e <= hi)


class Row:
    def __init__(self, label, ebb, peer=None, peer_name="", unit="", higher=False, ratio_key=None, target=None,
                 collapse=(), fmt=None, peer_unknown="missing"):
        self.label, self.ebb, self.peer, self.peer_name, self.unit = label, ebb, peer, peer_name, unit
        self.higher, self.ratio_key, self.target, self.collapse, self.fmt = higher, ratio_key, target, collapse, fmt
        self.peer_unknown = peer_unknown


def section(title):
    """A line of the table that heads the rows after it."""
    return title


SYSMEM = "mmap+munmap+brk+madvise"

# ops_peer's targets (issue 32): compute-bound ops >= 1.0, memory-bound ones >= 0.9, the 1-element
# add >= 3; libtorch's time / ebb's.
OPS_PEER_TARGET = {"softmax": 1.0, "log_softmax": 1.0, "exp": 1.0, "gelu": 1.0, "layer_norm": 1.0,
                   "cross_entropy": 1.0, "add": 0.9, "mul_scalar": 0.9, "relu": 0.9, "sum_last": 0.9,
                   "sum_first": 0.9, "mean": 0.9, "cat": 0.9, "transpose_contiguous": 0.9, "matmul": 0.9,
                   "add_1elem": 3.0}


def ops_peer_rows():
    rows = []
    for op, x in OPS_PEER_TARGET.items():
        rows.append(Row("`ops_peer op=%s pass={pass}` `ebb_ms`" % op, Sel("ops_peer", "ebb_ms", op=op, **{"pass": "*"}),
                        Sel("ops_peer", "libtorch_ms", op=op, **{"pass": "*"}), "libtorch", "ms", ratio_key="ratio",
                        target=ratio_at_least(x, ">= %g (issue 32)" % x)))
    return rows


def frag_exp1_1_05(e, p, r):
    return None if p > 1.05 else e <= 1.05


ROWS = [
    section("memory: device arena, pinned and host pools"),
    Row("`arena_fastpath dist=tensor` `ns_per_pair`", Sel("arena_fastpath", "ns_per_pair", impl="ebb", dist="tensor"),
        Sel("arena_fastpath", "ns_per_pair", agg="min", impl=["glibc", "jemalloc", "mimalloc"], dist="tensor"),
        "best of glibc, jemalloc, mimalloc", "ns", target=ebb_at_most(150, "<= 150 ns (issue 22 §2.3)")),
    Row("`arena_fastpath dist=small` `ns_per_pair`", Sel("arena_fastpath", "ns_per_pair", impl="ebb", dist="small"),
        Sel("arena_fastpath", "ns_per_pair", agg="min", impl=["glibc", "jemalloc", "mimalloc"], dist="small"),
        "best of glibc, jemalloc, mimalloc", "ns", target=ebb_at_most(150, "<= 150 ns (issue 22 §2.3)")),
    Row("`pinned size={size}` `ns_per_pair`", Sel("pinned", "ns_per_pair", impl="ebb", size="*"),
        Sel("pinned", "ns_per_pair", impl="cuMemHostAlloc", size="*"), "cuMemHostAlloc + cuMemFreeHost", "ns"),
    Row("`pinned` `driver_allocs_after_warmup` (the largest over the sizes)",
        Sel("pinned", "driver_allocs_after_warmup", agg="max"), target=ebb_at_most(0, "0 (issue 9)")),
    Row("`host live=1000` `ns_per_pair`", Sel("host", "ns_per_pair", impl="ebb"),
        Sel("host", "ns_per_pair", agg="min", impl=["glibc", "jemalloc"]), "best of glibc, jemalloc", "ns"),
    Row("`host` `segments_after_warmup`", Sel("host", "segments_after_warmup", impl="ebb"),
        target=ebb_at_most(0, "0: no mmap once warm (perf/bench_host.c)")),
    Row("`history` `ns_per_alloc`", Sel("history", "ns_per_alloc"), unit="ns",
        target=ebb_below(50, "< 50 ns (issue 33)")),
    Row("`history` `dump_s_per_million`", Sel("history", "dump_s_per_million"), unit="s",
        target=ebb_below(0.5, "< 0.5 s (issue 33; PyTorch 4-461 s)")),

    section("memory: fragmentation on real PyTorch training traces (perf/frag.sh)"),
    Row("`frag expandable=0` `frag_ratio`, each real trace", Sel("frag", "frag_ratio", trace="real_*", expandable="0"),
        Sel("frag", "ref_frag_ratio", trace="real_*", expandable="0"), "PyTorch's policy (frag_reference.c)",
        target=ratio_at_least(1.0, "<= the reference (issue 22 §1)"), collapse=["trace"]),
    Row("`frag expandable=1` `peak_reserved`, each real trace",
        Sel("frag", "peak_reserved", trace="real_*", expandable="1"),
        Sel("frag", "bf2m_peak_reserved", trace="real_*", expandable="1"), "plain best fit, 2 MiB granules (bf2m)", "MiB",
        target=Target("<= bf2m + 2 MiB (issue 29 §4)", lambda e, p, r: e <= p + 2 * MIB), collapse=["trace"],
        fmt=lambda v: "%.0f" % (v / MIB)),
    Row("`frag expandable=1` `frag_ratio`, each real trace", Sel("frag", "frag_ratio", trace="real_*", expandable="1"),
        Sel("frag", "bf2m_frag_ratio", trace="real_*", expandable="1"), "bf2m",
        target=Target("<= 1.05 where bf2m is (issue 29 §4)", frag_exp1_1_05), collapse=["trace"]),
    Row("`frag expandable=1` `frag_ratio` against PyTorch's, each real trace",
        Sel("frag", "frag_ratio", trace="real_*", expandable="1"),
        Sel("frag", "ref_frag_ratio", trace="real_*", expandable="1"), "PyTorch's policy, its 20 MiB pages",
        target=ratio_at_least(1.0, "<= PyTorch's policy (issue 22 §1)"), collapse=["trace"]),
    Row("`frag` `frag_ratio` on the synthetic traces, expandable=0 and 1",
        Sel("frag", "frag_ratio", trace=["mlp_fixed", "multistream", "transformer_varlen"], expandable="*"),
        Sel("frag", "ref_frag_ratio", trace=["mlp_fixed", "multistream", "transformer_varlen"], expandable="*"),
        "PyTorch's policy", collapse=["trace", "expandable"]),

    section("system calls"),
    Row("`syscalls work={work} malloc=jemalloc` mmap+munmap+brk+madvise",
        Sel("syscalls", SYSMEM, work="*", malloc="jemalloc"), Sel("syscalls", SYSMEM, work="*", malloc="glibc"),
        "the same on glibc's malloc", target=ebb_at_most(0, "0 in steady state (issues 2, 9)")),
    Row("`train_syscalls` mmap+munmap+brk+madvise in the steady steps (ebb-train's defaults)",
        Sel("train_syscalls", SYSMEM, impl="ebb"), Sel("train_syscalls", SYSMEM, impl="torch"),
        "python3-torch, the same MLP on one CPU thread", target=ebb_at_most(0, "0 (issue 33)")),
    Row("`train_syscalls` `per_step_total` (all calls, all threads)", Sel("train_syscalls", "per_step_total", impl="ebb"),
        Sel("train_syscalls", "per_step_total", impl="torch"), "python3-torch, the same MLP on one CPU thread"),

    section("streams and launch"),
    Row("`copy dir={dir} host={host}` `gbps`, each size from 1 MiB",
        Sel("copy", "gbps", dir="*", host="*", bytes=["1048576", "4194304", "16777216", "67108864"]),
        Sel("copy", "memcpy_gbps", dir="*", host="*", bytes=["1048576", "4194304", "16777216", "67108864"]),
        "memcpy of the same bytes", "GB/s", higher=True, ratio_key="ratio",
        target=ratio_at_least(0.8, ">= 0.8 from 1 MiB (issue 2)"), collapse=["bytes"]),
    Row("`launch impl=ebb` `ns_per_launch`", Sel("launch", "ns_per_launch", impl="ebb"),
        Sel("launch", "ns_per_call", impl="direct_call"), "a call through a function pointer", "ns"),

    section("ops"),
    Row("`ops_elementwise device={device}` `gbps`", Sel("ops_elementwise", "gbps", device="*"),
        Sel("ops_elementwise", "memcpy_gbps", device="*"), "memcpy", "GB/s", higher=True, ratio_key="ratio",
        target=ratio_at_least(0.5, ">= 0.5 (issue 4)")),
    Row("`ops_matmul n={n}` `gflops`", Sel("ops_matmul", "gflops", n="*"), Sel("ops_matmul", "blas_gflops", n="*"),
        "cblas_sgemm (OpenBLAS)", "GFLOP/s", higher=True, ratio_key="ratio",
        target=ratio_at_least(0.95, ">= 0.95 (issue 4)")),
    *ops_peer_rows(),
    Row("`mlp_step model=big variant=ops` `step_ms`", Sel("mlp_step", "step_ms", model="big", variant="ops", impl="ebb"),
        Sel("mlp_step", "step_ms", model="big", variant="ops", impl="libtorch"), "libtorch", "ms", ratio_key="ratio",
        target=ratio_at_least(1.0, ">= 1.0 (issue 32)")),
    Row("`mlp_step model=big variant=linear_sgd` `step_ms`",
        Sel("mlp_step", "step_ms", model="big", variant="linear_sgd", impl="ebb"),
        Sel("mlp_step", "step_ms", model="big", variant="linear_sgd", impl="libtorch"), "libtorch", "ms",
        ratio_key="ratio", target=ratio_at_least(1.1, ">= 1.1 (issue 32)")),
    Row("`mlp_step model=small variant={variant}` `step_ms`",
        Sel("mlp_step", "step_ms", model="small", variant="*", impl="ebb"),
        Sel("mlp_step", "step_ms", model="small", variant="*", impl="libtorch"), "libtorch", "ms",
        ratio_key="ratio", target=ratio_at_least(2.0, ">= 2 (issue 32)")),
    Row("`dnnl` `ebb_cpu_us`, each op", Sel("dnnl", "ebb_cpu_us", op="*"), Sel("dnnl", "dnnl_cpu_us", op="*"),
        "oneDNN 2.6 (thread CPU time)", "us", ratio_key="cpu_ratio",
        target=Target("oneDNN not > 10% faster, else use it (issue 32)", lambda e, p, r: r >= 1 / 1.1),
        collapse=["op"]),
    Row("`ops_linear` `linear_ms`", Sel("ops_linear", "linear_ms"), Sel("ops_linear", "composed_ms"),
        "transpose + matmul + add", "ms", ratio_key="ratio"),
    Row("`ops_add_scaled` `add_scaled_ms`", Sel("ops_add_scaled", "add_scaled_ms"), Sel("ops_add_scaled", "composed_ms"),
        "mul_scalar + add_", "ms", ratio_key="ratio"),
    Row("`ops_device device=0` `gbps` against the device's peak, each op",
        Sel("ops_device", "gbps", device="0", op="*"), Sel("ops_device", "peak_gbps", unknown=0, device="0", op="*"),
        "peak memory bandwidth (ebb_dev_caps)", "GB/s", higher=True, collapse=["op"],
        peer_unknown="unknown (an emulated device)"),

    section("training building blocks"),
    Row("`optim tensors=100` AdamW `step_ms`", Sel("optim", "step_ms", impl="ebb"), Sel("optim", "step_ms", impl="libtorch"),
        "torch::optim::AdamW", "ms", ratio_key="ratio", target=ratio_at_least(2.0, ">= 2 (issue 32 §4)")),

    section("autograd: backward engine"),
    *[Row("`engine graph=%s` `bwd_ns_per_node`" % g, Sel("engine", "bwd_ns_per_node", graph=g, impl="ebb"),
          Sel("engine", "bwd_ns_per_node", graph=g, impl="libtorch"), "libtorch", "ns",
          target=ratio_at_least(x, ">= %g: ebb <= %g of libtorch (issue 20)" % (x, 1 / x)))
      for g, x in [("chain", 5), ("wide", 5), ("tree", 5), ("reuse", 5), ("tree_grad_1", 50), ("tree_grad_64", 5),
                   ("tree_grad_512", 5)]],
    Row("`engine_devices` `two_dev_ms`", Sel("engine_devices", "two_dev_ms"), Sel("engine_devices", "one_dev_ms"),
        "the same graph on one device", "ms", target=ratio_at_least(1.8, "speedup >= 1.8 (issue 21)")),
    Row("`engine_devices` `worker_thread_ns_per_node`", Sel("engine_devices", "worker_thread_ns_per_node"),
        Sel("engine_devices", "calling_thread_ns_per_node"), "the calling-thread path", "ns"),
    Row("`engine_devices` `syscalls_per_backward`", Sel("engine_devices", "syscalls_per_backward"),
        target=ebb_at_most(0, "0 (issue 21)")),
    Row("`engine_devices` `events_per_cross_stream_edge`", Sel("engine_devices", "events_per_cross_stream_edge"),
        target=ebb_at_most(1, "<= 1 (issue 21)")),

    section("autograd: custom ops"),
    Row("`custom_op size={size}` `custom_ns`", Sel("custom_op", "custom_ns", size="*"), Sel("custom_op", "builtin_ns", size="*"),
        "ebb_op_mul (built-in)", "ns", target=ratio_at_least(1 / 1.1, "<= 1.1 of the built-in's (ratio >= 0.909; issue 34)")),

    section("autograd: offloaded saved tensors"),
    Row("`offload mode=prefetch` `peak_device_bytes`", Sel("offload", "peak_device_bytes", mode="prefetch"),
        Sel("offload", "peak_device_bytes", mode="none"), "mode=none", "MiB",
        target=ratio_at_least(2.0, "<= 0.5 of none's (ratio >= 2)"), fmt=lambda v: "%.1f" % (v / MIB)),
    Row("`offload mode=prefetch` `saved_peak_bytes`", Sel("offload", "saved_peak_bytes", mode="prefetch"),
        unit="MiB", target=ebb_at_most(12582912, "<= 3 layers' worth (12 MiB)"), fmt=lambda v: "%.1f" % (v / MIB)),
    Row("`offload mode=prefetch` `step_ms` against none", Sel("offload", "step_ms", mode="prefetch"),
        Sel("offload", "step_ms", mode="none"), "mode=none", "ms",
        target=ratio_at_least(1 / 1.05, "<= 1.05 of none's (ratio >= 0.952)")),
    Row("`offload mode=prefetch` `step_ms` against sync", Sel("offload", "step_ms", mode="prefetch"),
        Sel("offload", "step_ms", mode="sync"), "mode=sync (save_on_cpu)", "ms",
        target=ratio_at_least(1.25, "<= 0.8 of sync's (ratio >= 1.25)")),
    Row("`offload mode=prefetch` `first_step_ms`", Sel("offload", "first_step_ms", mode="prefetch"),
        Sel("offload", "step_ms", mode="none"), "mode=none's steady step", "ms",
        target=ratio_at_least(1 / 1.1, "<= 1.10 of none's steady step (ratio >= 0.909)")),
    Row("`offload` `copy_ratio`", Sel("offload", "copy_ratio", mode="prefetch"),
        target=ebb_between(0.45, 0.55, "0.45-0.55 (the calibration)")),
    Row("`offload_budget` `peak_device_bytes`", Sel("offload_budget", "peak_device_bytes"),
        Sel("offload_budget", "budget_bytes"), "the budget", "MiB",
        target=ratio_at_least(1.0, "never above the budget"), fmt=lambda v: "%.1f" % (v / MIB)),
    Row("`offload_budget` `step_ms` against the bound", Sel("offload_budget", "step_ms"),
        Sel("offload_budget", "bound_ms"), "bound_ms", "ms",
        target=ratio_at_least(1 / 1.1, "<= 1.10 of the bound (ratio >= 0.909)")),
    Row("`offload_budget` `step_ms` against sync", Sel("offload_budget", "step_ms"),
        Sel("offload_budget", "sync_step_ms"), "sync_step_ms", "ms",
        target=Target("below sync (ratio > 1)", lambda e, p, r: r > 1)),
    Row("`offload_budget` `copy_ratio`", Sel("offload_budget", "copy_ratio"),
        target=ebb_between(1.9, 2.1, "1.9-2.1 (the calibration)")),

    section("autograd: custom functions"),
    Row("`custom_function inputs={inputs}` `custom_ns`", Sel("custom_function", "custom_ns", inputs="*"),
        Sel("custom_function", "direct_ns", inputs="*"), "the same adds called directly", "ns",
        target=Target("<= direct + 1 us (issue 34)", lambda e, p, r: e <= p + 1000)),

    section("distributed: the data-parallel reducer (2 ranks, Open MPI, emulated devices)"),
    # (its target, <= last_bucket_ms + 0.1 x allreduce_ms (issue 35), takes a third figure: perf/RESULTS.md judges it)
    Row("`ddp` `exposed_comm_ms`", Sel("ddp", "exposed_comm_ms"), Sel("ddp", "allreduce_ms"), "the buckets' all-reduces alone", "ms"),
    Row("`ddp` `extra_bytes`", Sel("ddp", "extra_bytes"), Sel("ddp", "bucket_bytes"), "the largest bucket", "MiB",
        target=Target("<= bucket_bytes (issue 35)", lambda e, p, r: e <= p), fmt=lambda v: "%.1f" % (v / MIB)),

    section("autograd: map over 64 slices"),
    Row("`map mode=save` `step_ms` against the loop", Sel("map", "step_ms", mode="save"),
        Sel("map", "loop_step_ms", mode="save"), "the explicit loop", "ms",
        target=ratio_at_least(1 / 1.05, "<= 1.05 of the loop's (ratio >= 0.952) (issue 34)")),
    Row("`map mode=save` `peak_bytes` against the loop", Sel("map", "peak_bytes", mode="save"),
        Sel("map", "loop_peak_bytes", mode="save"), "the explicit loop", "MiB", fmt=lambda v: "%.1f" % (v / MIB)),
    Row("`map mode=checkpoint` `peak_bytes`", Sel("map", "peak_bytes", mode="checkpoint"),
        Sel("map", "peak_bytes", mode="save"), "mode=save", "MiB",
        target=ratio_at_least(4.0, "<= 0.25 of save's (ratio >= 4) (issue 34)"), fmt=lambda v: "%.1f" % (v / MIB)),
    Row("`map mode=checkpoint` `step_peak_bytes` (above the step's start)", Sel("map", "step_peak_bytes", mode="checkpoint"),
        Sel("map", "step_peak_bytes", mode="save"), "mode=save", "MiB", fmt=lambda v: "%.1f" % (v / MIB)),
    Row("`map mode=checkpoint` `step_ms` against save", Sel("map", "step_ms", mode="checkpoint"),
        Sel("map", "step_ms", mode="save"), "mode=save", "ms",
        target=ratio_at_least(1 / 1.4, "<= 1.4 of save's (ratio >= 0.714) (issue 34)")),
]


# ---- reading the lines ---------------------------------------------------------------------------

def parse(lines):
    """The `bench=` lines as dicts of their key=value words (other words dropped)."""
    out = []
    for line in lines:
        i = line.find("bench=")
        if i < 0:
            continue
        d = {}
        for w in line[i:].split():
            k, eq, v = w.partition("=")
            if eq and k not in d:
                d[k] = v
        out.append(d)
    return out


def number(s):
    try:
        v = float(s)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def value(d, sel, key=None):
    """The figure of selector sel (or its `key`) on line d, or None."""
    total = 0.0
    for k in (key or sel.key).split("+"):
        v = number(d.get(k))
        if v is None:
            return None
        total += v
    return None if key is None and sel.unknown is not None and total == sel.unknown else total


def matches(d, bench, filters, fixed):
    """Whether line d is of `bench` and passes the filters, with the enumerated keys at `fixed`."""
    if d.get("bench") != bench:
        return False
    for k, want in filters.items():
        want = fixed.get(k, want)
        have = d.get(k)
        wants = want if isinstance(want, list) else [want]
        if have is None or not any(fnmatch.fnmatchcase(have, w) for w in wants):
            return False
    return True


def select(lines, sel, fixed, key=None):
    """The figures of sel in lines, and why it was skipped where it has none."""
    vals = [value(d, sel, key) for d in lines if matches(d, sel.bench, sel.filters, fixed)]
    vals = [v for v in vals if v is not None]
    skipped = None
    if not vals:
        # `bench=<name> [key=value...] skipped=<why>`: the program or its peer is not built here
        for d in lines:
            if d.get("bench") == sel.bench and "skipped" in d:
                if matches(d, sel.bench, {k: v for k, v in sel.filters.items() if k in d}, fixed):
                    skipped = d["skipped"]
    return vals, skipped


def fold(vals, agg):
    if not vals:
        return None
    return {"min": min, "max": max}.get(agg, statistics.median)(vals)


def oriented(row, e, p):
    num, den = (e, p) if row.higher else (p, e)
    if den == 0:
        return 1.0 if num == 0 else None
    return num / den


def ratio_of(row, e_vals, p_vals, e, p, r_vals):
    if r_vals:
        return statistics.median(r_vals)
    if e is None or p is None:
        return None
    if len(e_vals) == len(p_vals) > 1 and row.ebb.agg == row.peer.agg == "median":
        rs = [r for r in (oriented(row, a, b) for a, b in zip(e_vals, p_vals)) if r is not None]
        return statistics.median(rs) if rs else None
    return oriented(row, e, p)


def enumerate_keys(lines, row):
    """The values of the row's enumerated keys seen in ebb's lines: a list of dicts, in order."""
    keys = [k for k, v in row.ebb.filters.items() if v == "*" and k not in row.collapse] + list(row.collapse)
    if not keys:
        return [{}]
    seen = []
    for d in lines:
        if matches(d, row.ebb.bench, row.ebb.filters, {}) and value(d, row.ebb) is not None:
            fx = {k: d[k] for k in keys}
            if fx not in seen:
                seen.append(fx)
    return seen or [{}]


def evaluate(lines, row, fixed):
    e_vals, e_skip = select(lines, row.ebb, fixed)
    p_vals, p_skip = select(lines, row.peer, fixed) if row.peer else ([], None)
    r_vals = []
    if row.ratio_key:
        # the program's own ratio: on ebb's line, or on a line of its own without `impl`
        r_vals, _ = select(lines, row.ebb, fixed, key=row.ratio_key)
        if not r_vals and "impl" in row.ebb.filters:
            f = {k: v for k, v in row.ebb.filters.items() if k != "impl"}
            r_vals = [value(d, row.ebb, row.ratio_key) for d in lines if matches(d, row.ebb.bench, f, fixed) and
                      "impl" not in d and value(d, row.ebb, row.ratio_key) is not None]
    e, p = fold(e_vals, row.ebb.agg), fold(p_vals, row.peer.agg) if row.peer else None
    r = ratio_of(row, e_vals, p_vals, e, p, r_vals) if row.peer else None
    met = None
    if row.target and e is not None:
        try:
            met = row.target.check(e, p, r)
        except TypeError:  # a check that needs the peer's figure or the ratio, which is missing
            met = None
    return dict(e=e, p=p, r=r, met=met, e_skip=e_skip, p_skip=p_skip, fixed=fixed)


# ---- the table -----------------------------------------------------------------------------------

def fmt_num(v, row=None):
    if v is None:
        return ""
    if row is not None and row.fmt:
        return row.fmt(v)
    a = abs(v)
    if v == int(v) and a < 1e15:
        return "%d" % v
    if a >= 100:
        return "%.0f" % v
    if a >= 10:
        return "%.1f" % v
    if a >= 1:
        return "%.2f" % v
    return "%.3g" % v


def fmt_ratio(r):
    if r is None:
        return ""
    return "%.0f" % r if abs(r) >= 1000 else "%.3g" % r


def fmt_range(vals, f):
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    lo, hi = min(vals), max(vals)
    return f(lo) if f(lo) == f(hi) else "%s-%s" % (f(lo), f(hi))


def fmt_key(k, v):
    """An enumerated key's value as the table shows it: sizes in bytes as KiB or MiB."""
    n = number(v)
    if k in ("bytes", "size") and n and n == int(n) and int(n) % 1024 == 0:
        n = int(n)
        return "%d MiB" % (n >> 20) if n % (1 << 20) == 0 else "%d KiB" % (n >> 10)
    return v


class _Star(dict):
    def __missing__(self, key):
        return "*"


def label(row, fixed):
    return row.label.format_map(_Star({k: fmt_key(k, v) for k, v in fixed.items()}))


def missing(skip, row, peer=False):
    if skip == "not_built":
        return "not built"
    if skip and skip.endswith("_not_found"):
        return "not built (%s not found)" % skip[:-len("_not_found")].replace("_", " ")
    if skip:
        return "skipped (%s)" % skip.replace("_", " ")
    return row.peer_unknown if peer else "missing"


def with_unit(s, row):
    return s + (" " + row.unit if row.unit else "")


def plain_row(row, x):
    e_cell = with_unit(fmt_num(x["e"], row), row) if x["e"] is not None else missing(x["e_skip"], row)
    p_cell = ""
    if row.peer:
        p_cell = with_unit(fmt_num(x["p"], row), row) if x["p"] is not None else missing(x["p_skip"], row, True)
        if x["p"] is not None and row.peer_name:
            p_cell = "%s: %s" % (row.peer_name, p_cell)
    met = "" if row.target is None else {True: "met", False: "**gap**", None: "n.a."}[x["met"]]
    return [label(row, x["fixed"]), e_cell, p_cell, fmt_ratio(x["r"]), row.target.text if row.target else "", met]


def collapsed_row(row, results):
    """One row for results that differ in the row's collapse keys."""
    found = [x for x in results if x["e"] is not None]
    name = lambda x: " ".join(fmt_key(k, x["fixed"][k]) for k in row.collapse)
    e = fmt_range([x["e"] for x in found], lambda v: fmt_num(v, row))
    e_cell = "%s over %d" % (with_unit(e, row), len(found)) if e else missing(results[0]["e_skip"], row)
    p_cell = ""
    if row.peer:
        p = fmt_range([x["p"] for x in found], lambda v: fmt_num(v, row))
        p_cell = "%s: %s" % (row.peer_name, with_unit(p, row)) if p else missing(results[0]["p_skip"], row, True)
    r = fmt_range([x["r"] for x in found], fmt_ratio) or ""
    met = ""
    if row.target is not None and found:
        judged = [x for x in found if x["met"] is not None]
        gaps = [x for x in judged if x["met"] is False]
        met = "met in %d of %d" % (len(judged) - len(gaps), len(judged))
        if len(judged) < len(found):
            met += " (%d n.a.)" % (len(found) - len(judged))
        if gaps:
            met += "; **gap**: " + ", ".join(
                "%s (%s%s)" % (name(x), fmt_num(x["e"], row), "" if x["r"] is None else ", ratio " + fmt_ratio(x["r"]))
                for x in gaps)
    elif row.target is not None:
        met = "n.a."
    fixed = {k: v for k, v in results[0]["fixed"].items() if k not in row.collapse}
    return [label(row, fixed), e_cell, p_cell, r, row.target.text if row.target else "", met]


def table(lines):
    out = ["| benchmark (`bench=` name and key) | ebb | peer | ratio (above 1: ebb better) | target | met |",
           "|---|---|---|---|---|---|"]
    counts = {"met": 0, "gap": 0, "open": 0}
    for row in ROWS:
        if isinstance(row, str):
            out.append("| **%s** | | | | | |" % row)
            continue
        groups = {}
        for fx in enumerate_keys(lines, row):
            split = tuple((k, v) for k, v in fx.items() if k not in row.collapse)
            groups.setdefault(split, []).append(evaluate(lines, row, fx))
        for results in groups.values():
            cells = collapsed_row(row, results) if row.collapse else plain_row(row, results[0])
            if row.target:
                met = cells[5]
                counts["gap" if "gap" in met else "met" if met.startswith("met") else "open"] += 1
            out.append("| " + " | ".join(cells) + " |")
    out.append("")
    out.append("Rows with a target: %d met, %d with a gap, %d without a figure to judge (missing, not built or n.a.)."
               % (counts["met"], counts["gap"], counts["open"]))
    return "\n".join(out)


def main(argv):
    lines = []
    if len(argv) > 1:
        for path in argv[1:]:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines += parse(f)
    else:
        lines = parse(sys.stdin)
    print(table(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
