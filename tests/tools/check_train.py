#!/usr/bin/env python3
"""ebb-train and ebb-memviz run as a user runs them.

usage: check_train.py CASE EBB_TRAIN EBB_MEMVIZ [CHROMIUM]

Cases:
  offload_1dev, offload_2dev, transformer  offload on and off train to the same losses, offload
                                           lowers the peak device bytes; the three files are
                                           written and parse
  progress     plain progress lines off a terminal, the documented last line, --quiet
  bad_input    every bad option or setting: exit code 2, a message, no file left behind
  memviz       a recorded snapshot to a page and an SVG; malformed and truncated snapshots refused
  dist         under mpirun (MPIEXEC and its flags follow the programs): 2 ranks train the MLP and
               the transformer with --dist mpi, one emulated device each; the last line says
               ranks=2 and params_in_sync=yes, the mean loss falls, only rank 0 writes the files;
               --dist nccl on the emulated driver is refused with exit code 2; ranks given
               different options (mpirun's colon syntax) are refused at the start with exit code
               2 naming the option, instead of training apart until a timeout; rank 0 out of
               device memory leaves its snapshot, page and trace, as one process does
  browser      the page in headless Chromium: the series drawn, no console error, load and redraw
               times printed, a screenshot (also for a snapshot of 10^6 history entries)
"""
import json
import os
import re
import subprocess
import sys
import tempfile

LAST = re.compile(r"^loss=(\S+)->(\S+) ms_per_step=(\S+) peak_device_bytes=([0-9,]+) "
                  r"offloaded_bytes=(\d+) stalls=(\d+)$")
DIST_LAST = re.compile(LAST.pattern[:-1] + r" ranks=(\d+) params_in_sync=yes$")
SANITIZED = os.environ.get("EBB_TEST_SANITIZED") == "1"


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def run(cmd, cwd, expect_rc=0, env=None, timeout=600):
    e = dict(os.environ)
    if env:
        e.update(env)
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=e, timeout=timeout)
    except subprocess.TimeoutExpired:
        fail(f"{' '.join(cmd)}: still running after {timeout} s, expected it to end")
    if p.returncode != expect_rc:
        fail(f"{' '.join(cmd)}: exit {p.returncode}, expected {expect_rc}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def train(exe, cwd, *args):
    p = run([exe, "--quiet", *args], cwd)
    lines = p.stdout.strip().splitlines()
    if len(lines) != 1:
        fail(f"--quiet printed {len(lines)} lines, expected the last line only:\n{p.stdout}")
    m = LAST.match(lines[0])
    if not m:
        fail(f"the last line does not read as documented: {lines[0]!r}")
    return {"first": float(m.group(1)), "last": float(m.group(2)), "ms": float(m.group(3)),
            "peaks": [int(x) for x in m.group(4).split(",")], "offloaded": int(m.group(5)),
            "stalls": int(m.group(6))}


def check_files(cwd):
    for f in ("mem.json", "trace.json"):
        with open(os.path.join(cwd, f)) as fh:
            json.load(fh)
    with open(os.path.join(cwd, "mem.html")) as fh:
        page = fh.read()
    if "EBB_MEMVIZ_DATA" in page or '<script id="pool0"' not in page:
        fail("mem.html lacks its data")
    leftovers = [f for f in os.listdir(cwd) if ".tmp." in f]
    if leftovers:
        fail(f"temporary files left behind: {leftovers}")


def case_offload(exe, devices, model):
    steps = "3" if SANITIZED else "6"
    args = ["--steps", steps, "--devices", str(devices)]
    if model == "transformer":
        args += ["--model", "transformer", "--layers", "2", "--hidden", "64", "--batch", "32"]
    else:
        args += ["--layers", "8", "--hidden", "256", "--batch", "512"]
    with tempfile.TemporaryDirectory() as d:
        on = train(exe, d, *args, "--offload", "on")
        check_files(d)
        off = train(exe, d, *args, "--offload", "off")
    print("offload on: ", on)
    print("offload off:", off)
    if len(on["peaks"]) != devices:
        fail(f"{len(on['peaks'])} peaks for {devices} devices")
    for k in ("first", "last"):
        if abs(on[k] - off[k]) > 1e-4 * max(1.0, abs(off[k])):
            fail(f"the {k} loss differs with offload: {on[k]} against {off[k]}")
    if not on["last"] < on["first"]:
        fail(f"the loss did not fall: {on['first']} -> {on['last']}")
    if on["offloaded"] == 0 or off["offloaded"] != 0:
        fail("offloaded bytes: expected some with offload on and none with it off")
    if not sum(on["peaks"]) < sum(off["peaks"]):
        fail(f"offload did not lower the peak device bytes: {on['peaks']} against {off['peaks']}")


def case_progress(exe):
    with tempfile.TemporaryDirectory() as d:
        p = run([exe, "--steps", "3", "--layers", "2", "--hidden", "64", "--batch", "64"], d)
    lines = p.stdout.strip().splitlines()
    if len(lines) != 4 or "\r" in p.stdout or "\033" in p.stdout:
        fail(f"expected three plain progress lines and the last line off a terminal:\n{p.stdout!r}")
    for i, l in enumerate(lines[:3]):
        if not re.match(rf"^step {i + 1}/3  loss \d+\.\d+  \d+\.\d ms/step  peak dev0 .* pinned peak .* offloaded .* stalls \d+$", l):
            fail(f"progress line {i + 1} does not read as expected: {l!r}")
    if not LAST.match(lines[3]):
        fail(f"last line: {lines[3]!r}")


def case_bad_input(exe):
    bad = [
        (["--bogus"], "unknown option '--bogus'"),
        (["--steps"], "--steps needs a value"),
        (["--steps", "0"], "--steps '0': expected a count"),
        (["--batch", "-4"], "--batch '-4': expected a count"),
        (["--hidden", "12x"], "--hidden '12x'"),
        (["--model", "rnn"], "--model 'rnn': expected mlp or transformer"),
        (["--offload", "maybe"], "--offload 'maybe': expected on or off"),
        (["--devices", "64"], "--devices 64, but this machine has"),
        (["--device-budget", "1000"], "--device-budget 1000 is below the largest tensor"),
        (["--device-budget", "-1"], "--device-budget '-1': expected bytes"),
        (["--model", "transformer", "--hidden", "30"], "give a multiple of 4"),
        (["--snapshot", "/nonexistent-dir/mem.json"], "cannot write '/nonexistent-dir/mem.json'"),
        (["--trace", ""], "--trace: expected a file name"),
        (["--snapshot", "same.out", "--trace", "same.out"], "--snapshot and --trace are both 'same.out'"),
        (["--timeline", "."], "cannot write '.': it exists and is not a regular file"),
        (["--dist", "tcp"], "--dist 'tcp': expected none, mpi or nccl"),
        (["--dist", "mpi", "--devices", "1"], "--devices with --dist: each rank trains on one device"),
    ]
    for args, msg in bad:
        with tempfile.TemporaryDirectory() as d:
            p = run([exe, "--steps", "2", *args], d, expect_rc=2)
            if msg not in p.stderr:
                fail(f"{args}: stderr lacks {msg!r}:\n{p.stderr}")
            if os.listdir(d):
                fail(f"{args}: files left behind: {os.listdir(d)}")
    for value in ["x", "-1", "2steps"]:
        with tempfile.TemporaryDirectory() as d:
            p = run([exe, "--steps", "2"], d, expect_rc=2, env={"EBB_TRAIN_SYSCALL_MARKERS": value})
            if f"EBB_TRAIN_SYSCALL_MARKERS='{value}'" not in p.stderr or os.listdir(d):
                fail(f"EBB_TRAIN_SYSCALL_MARKERS={value!r}: no message or files left behind:\n{p.stderr}")
    print(f"{len(bad)} bad command lines and 3 bad EBB_TRAIN_SYSCALL_MARKERS refused with exit code 2")


def case_dist(exe, mpiexec):
    steps = "3" if SANITIZED else "8"
    env = {"EBB_SIM_DEVICES": "1"}
    models = [["--layers", "4", "--hidden", "128", "--batch", "128"],
              ["--model", "transformer", "--layers", "2", "--hidden", "32", "--batch", "16"]]
    for margs in models:
        with tempfile.TemporaryDirectory() as d:
            p = run(mpiexec + ["-np", "2", exe, "--quiet", "--dist", "mpi", "--steps", steps, *margs], d, env=env)
            lines = p.stdout.strip().splitlines()
            if len(lines) != 1:
                fail(f"2 ranks with --quiet printed {len(lines)} lines, expected rank 0's last line only:\n{p.stdout}")
            m = DIST_LAST.match(lines[0])
            if not m:
                fail(f"the last line does not read as documented for --dist: {lines[0]!r}")
            if int(m.group(7)) != 2:
                fail(f"ranks={m.group(7)}, expected 2")
            if not float(m.group(2)) < float(m.group(1)):
                fail(f"the mean loss did not fall: {lines[0]}")
            check_files(d)
            if sorted(os.listdir(d)) != ["mem.html", "mem.json", "trace.json"]:
                fail(f"expected rank 0's three files only, found {sorted(os.listdir(d))}")
            print(" ".join(margs[:2]), lines[0])
    with tempfile.TemporaryDirectory() as d:
        p = run([exe, "--dist", "nccl", "--steps", "2"], d, expect_rc=2, env=env)
        if "NCCL" not in p.stderr or os.listdir(d):
            fail(f"--dist nccl on the emulated driver: no message naming NCCL, or files left:\n{p.stderr}")
    # Rank 0 runs out of device memory in its first step: like a single process, it leaves the
    # memory at the failure (the other rank, waiting in a collective, is ended by mpirun).
    with tempfile.TemporaryDirectory() as d:
        big = ["--quiet", "--dist", "mpi", "--steps", "2", "--layers", "4", "--hidden", "512", "--batch", "1024"]
        p = run(mpiexec + ["-np", "1", "-x", "EBB_SIM_MEM=12M", exe, *big, ":", "-np", "1", exe, *big], d, expect_rc=1,
                env=env, timeout=120)
        if "rank 0: training step failed" not in p.stderr or "the memory at the failure" not in p.stderr:
            fail(f"rank 0 out of memory: no message naming the failure and its files:\n{p.stderr}")
        check_files(d)
        print("rank 0 out of memory: its snapshot, page and trace written")
    # Ranks that disagree on an option that must match (here --steps: one rank would wait in a
    # collective the other never issues, until the groups' 5-minute timeout).
    small = ["--quiet", "--dist", "mpi", "--layers", "2", "--hidden", "32", "--batch", "16"]
    for opt, a, b in (("--steps", "3", "4"), ("--seed", "1", "2")):
        with tempfile.TemporaryDirectory() as d:
            p = run(mpiexec + ["-np", "1", exe, *small, opt, a, ":", "-np", "1", exe, *small, opt, b], d,
                    expect_rc=2, env=env, timeout=120)
            if f"{opt} {b}" not in p.stderr or f"{opt} {a}" not in p.stderr or os.listdir(d):
                fail(f"ranks with {opt} {a} and {opt} {b}: no message naming both, or files left:\n{p.stderr}")
            print(f"ranks with {opt} {a} and {b} refused:", p.stderr.strip().splitlines()[0])


def make_snapshot(d, exe):
    run([exe, "--quiet", "--steps", "3", "--layers", "4", "--hidden", "256", "--batch", "256"], d)
    return os.path.join(d, "mem.json")


def case_memviz(train_exe, viz):
    with tempfile.TemporaryDirectory() as d:
        snap = make_snapshot(d, train_exe)
        out, svg = os.path.join(d, "v.html"), os.path.join(d, "v.svg")
        run([viz, snap, "-o", out, "--svg", svg], d)
        with open(svg) as fh:
            s = fh.read()
        if not s.startswith("<svg") or "device 0" not in s or "parameter" not in s:
            fail("the SVG lacks its chart")
        run([viz, snap], d)  # default output: mem.html beside it
        text = open(snap).read()
        cases = {
            "truncated.json": (text[: len(text) // 2], "is not a complete snapshot"),
            "garbage.json": ("{\"segments\": [1, 2", "a segment object was expected"),
            "wrongtype.json": ("{\"segments\": [], \"device_traces\": [[{\"action\": 3}]]}", "a string was expected"),
            "empty.json": ("", "is not a complete snapshot"),
            "notsnap.json": ("{\"hello\": 1}", "\"segments\" and \"device_traces\" are both required"),
            "trailing.json": (text + "x", "continues after its top-level object"),
        }
        for name, (body, msg) in cases.items():
            path = os.path.join(d, name)
            with open(path, "w") as fh:
                fh.write(body)
            outp = os.path.join(d, name + ".html")
            p = run([viz, path, "-o", outp, "--svg", outp + ".svg"], d, expect_rc=2)
            if msg not in p.stderr or name not in p.stderr:
                fail(f"{name}: stderr lacks {msg!r} and the file name:\n{p.stderr}")
            if os.path.exists(outp) or os.path.exists(outp + ".svg"):
                fail(f"{name}: a partial output was left behind")
        # Well-formed snapshots with nothing to sort: a device whose one segment holds no block and
        # whose history is empty (a pool without events), and no device at all (no pools).
        quiet = {
            "idle.json": '{"segments":[{"device":0,"address":4096,"total_size":2097152,"blocks":[]}],'
                         '"device_traces":[[]]}',
            "nodevice.json": '{"segments":[],"device_traces":[]}',
        }
        for name, body in quiet.items():
            path = os.path.join(d, name)
            with open(path, "w") as fh:
                fh.write(body)
            outp = os.path.join(d, name + ".html")
            run([viz, path, "-o", outp, "--svg", outp + ".svg"], d)
            if not os.path.exists(outp) or not open(outp + ".svg").read().startswith("<svg"):
                fail(f"{name}: no page or SVG written")
        run([viz, os.path.join(d, "missing.json")], d, expect_rc=2)
        # an owner object without a name is nobody's, not a crash
        noname = os.path.join(d, "noname.json")
        with open(noname, "w") as fh:
            fh.write('{"segments":[],"device_traces":[[{"action":"alloc","addr":4096,"size":512,"stream":0,'
                     '"time_us":1,"owner":{"category":"saved"}}]]}')
        run([viz, noname, "-o", os.path.join(d, "noname.html"), "--svg", os.path.join(d, "noname.svg")], d)
        p = run([viz, snap, "-o", snap], d, expect_rc=2)
        if "is the snapshot itself" not in p.stderr or json.load(open(snap)) is None:
            fail("ebb-memviz -o over its own input was not refused")
        p = run([viz, snap, "-o", "a.x", "--svg", "a.x"], d, expect_rc=2)
        big_dev = os.path.join(d, "bigdev.json")
        with open(big_dev, "w") as fh:
            fh.write('{"segments":[{"device":1e12,"address":1,"total_size":1,"blocks":[]}],"device_traces":[]}')
        p = run([viz, big_dev, "-o", os.path.join(d, "bigdev.html")], d, expect_rc=2)
        if "not a device number" not in p.stderr:
            fail("a segment's absurd device number was not refused: " + p.stderr)
        run([viz, snap, "-o", "/nonexistent-dir/x.html"], d, expect_rc=1)
        run([viz, "--frobnicate"], d, expect_rc=2)
    print("ebb-memviz: page, SVG and", len(cases), "malformed snapshots refused")


def big_snapshot(path, n):
    """A snapshot of n history entries on one device: allocations and frees of a few hundred
    live blocks of every owner category, as a long training run leaves in the ring."""
    cats = ["parameter", "gradient", "saved", "activation", "optimizer", "staging", "backward", "other"]
    with open(path, "w") as f:
        f.write('{"segments":[{"device":0,"address":4096,"total_size":1073741824,"blocks":[]}],"device_traces":[[')
        live = []
        t = 1000
        base = 1 << 32
        for i in range(n):
            t += 3
            if len(live) > 400 or (live and i % 2):
                a, sz, c = live.pop((i * 7919) % len(live))
                act = "free_completed"
            else:
                a, sz, c = base + i * 4096, 4096 * (1 + i % 97), cats[(i // 2) % 8]
                live.append((a, sz, c))
                act = "alloc"
            f.write('%s{"action":"%s","addr":%d,"size":%d,"requested_size":%d,"stream":7,"time_us":%d,'
                    '"device":0,"frames":[],"owner":{"category":"%s","name":"op%d"}}'
                    % ("," if i else "", act, a, sz, sz, t, c, i % 500))
        f.write(']],"host_pools":[],"allocator_settings":{}}\n')


def chromium_selftest(chromium, page, shot):
    if not os.path.exists(chromium):
        fail("chromium was not found when the build was configured: apt-get install -y chromium "
             "(the README's first command installs it), then configure again")
    base = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--window-size=1400,1800"]
    p = subprocess.run(base + ["--enable-logging=stderr", "--v=0", "--dump-dom", "file://" + page + "#selftest"],
                       capture_output=True, text=True, timeout=300)
    m = re.search(r'<pre id="selftest">(.*?)</pre>', p.stdout, re.S)
    if not m:
        fail(f"the page did not report its self test (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    res = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))
    console = [l for l in p.stderr.splitlines() if "CONSOLE" in l and ("Uncaught" in l or "rror" in l)]
    if res["errors"] or console:
        fail(f"console errors: {res['errors']} {console}")
    subprocess.run(base + ["--screenshot=" + shot, "file://" + page], capture_output=True, timeout=300)
    if not os.path.exists(shot) or os.path.getsize(shot) < 1000:
        fail("no screenshot")
    return res


def case_browser(train_exe, viz, chromium, shots):
    with tempfile.TemporaryDirectory() as d:
        snap = make_snapshot(d, train_exe)
        page = os.path.join(d, "mem.html")
        res = chromium_selftest(chromium, page, os.path.join(shots, "memviz_train.png"))
        print("ebb-train page:", json.dumps(res))
        dev = [p for p in res["pools"] if p["title"].startswith("device")]
        if len(dev) < 1 or not res["hover_ok"]:
            fail("no device chart, or hover gave nothing")
        for p in dev:
            for series in ("parameter", "gradient", "optimizer", "activation", "saved"):
                if series not in p["drawn"]:
                    fail(f"{p['title']}: the {series} series was not drawn ({p['drawn']})")
        pinned = [p for p in res["pools"] if p["title"].startswith("pinned")]
        if not pinned or "saved" not in pinned[0]["drawn"]:
            fail(f"the pinned pool's offloaded saved tensors were not drawn: {res['pools']}")
        # owner names and pool titles are the program's strings: shown, never run as markup
        evil = os.path.join(d, "evil.json")
        tag = "<img src=x onerror=document.body.dataset.xss=1>"
        with open(evil, "w") as fh:
            fh.write('{"segments":[],"device_traces":[[{"action":"alloc","addr":4096,"size":512,"stream":0,"time_us":1,'
                     '"owner":{"category":"parameter","name":"%s"}}]],"host_pools":[{"pool":"pinned","label":"%s",'
                     '"segments":[],"trace":[{"action":"alloc","addr":8192,"size":512,"stream":0,"time_us":2,'
                     '"owner":{"category":"saved","name":"%s"}}]}]}' % (tag, tag, tag))
        run([viz, evil, "-o", os.path.join(d, "evil.html")], d)
        dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                              "file://" + os.path.join(d, "evil.html") + "#selftest"],
                             capture_output=True, text=True, timeout=300).stdout
        if "data-xss" in dom or 'selftest">' not in dom:
            fail("an owner name or pool title ran as markup in the page")
        n = 100000 if SANITIZED else 1000000
        big = os.path.join(d, "big.json")
        big_snapshot(big, n)
        run([viz, big, "-o", os.path.join(d, "big.html")], d)
        res = chromium_selftest(chromium, os.path.join(d, "big.html"), os.path.join(shots, "memviz_big.png"))
        if res["pools"][0]["events"] != n or len(res["pools"][0]["drawn"]) != 8:
            fail(f"the large snapshot's chart is incomplete: {res['pools']}")
        print(f"bench=memviz entries={n} load_ms={res['load_ms']:.0f} redraw_ms={res['redraw_ms']:.1f} "
              f"hover_ms={res['hover_ms']:.1f}")


def main():
    case, exe, viz = sys.argv[1], sys.argv[2], sys.argv[3]
    if case == "offload_1dev":
        case_offload(exe, 1, "mlp")
    elif case == "offload_2dev":
        case_offload(exe, 2, "mlp")
    elif case == "transformer":
        case_offload(exe, 2, "transformer")
    elif case == "progress":
        case_progress(exe)
    elif case == "bad_input":
        case_bad_input(exe)
    elif case == "memviz":
        case_memviz(exe, viz)
    elif case == "dist":
        case_dist(exe, sys.argv[4:])
    elif case == "browser":
        case_browser(exe, viz, sys.argv[4], sys.argv[5])
    else:
        fail("unknown case " + case)
    print("ok")


if __name__ == "__main__":
    main()
