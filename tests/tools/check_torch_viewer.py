#!/usr/bin/env python3
"""PyTorch's own memory viewer (Debian's python3-torch, torch 1.13) reads ebb's snapshot after
tools/ebb-snapshot-to-torch.py: `python3 -m torch.cuda._memory_viz stats` as a command, and its
`segments` and `memory` flame-graph inputs from Python with a local formatter (the command
downloads flamegraph.pl from the network, which these machines cannot reach).

usage: check_torch_viewer.py EBB_TRAIN CONVERTER
Exit 77 (skipped, with the reason) when no python3 with torch is found.
"""
import os
import pickle
import shutil
import subprocess
import sys
import tempfile

PY_CANDIDATES = ["/usr/bin/python3", shutil.which("python3") or ""]


def torch_python():
    for py in PY_CANDIDATES:
        if py and os.path.exists(py) and subprocess.run([py, "-c", "import torch"], capture_output=True).returncode == 0:
            return py
    return None


def main():
    train, conv = sys.argv[1], sys.argv[2]
    py = torch_python()
    if not py:
        print("SKIP: no python3 with torch (apt-get install -y python3-torch) to check PyTorch's viewer")
        return 77
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.run([train, "--quiet", "--steps", "2", "--layers", "4", "--hidden", "256", "--batch", "256"],
                           cwd=d, capture_output=True, text=True)
        if p.returncode:
            print("FAIL: ebb-train:", p.stderr)
            return 1
        pk = os.path.join(d, "mem.pickle")
        p = subprocess.run([py, conv, os.path.join(d, "mem.json"), pk], capture_output=True, text=True)
        if p.returncode:
            print("FAIL: the converter:", p.stderr)
            return 1
        p = subprocess.run([py, "-m", "torch.cuda._memory_viz", "stats", pk], capture_output=True, text=True)
        print(p.stdout)
        if p.returncode or "'segments':" not in p.stdout or "active_allocated" not in p.stdout:
            print("FAIL: torch.cuda._memory_viz stats:", p.stderr)
            return 1
        code = (
            "import pickle, sys\n"
            "from torch.cuda import _memory_viz as mv\n"
            "snap = pickle.load(open(sys.argv[1], 'rb'))\n"
            "local = lambda lines: lines\n"
            "seg = mv.segments(snap, format_flamegraph=local)\n"
            "mem = mv.memory(snap, format_flamegraph=local)\n"
            "print('segments_lines', len(seg.splitlines()))\n"
            "print('memory_lines', len(mem.splitlines()))\n"
            "print(mem)\n")
        p = subprocess.run([py, "-c", code, pk], capture_output=True, text=True)
        if p.returncode:
            print("FAIL: segments/memory:", p.stderr)
            return 1
        out = p.stdout
        print("\n".join(out.splitlines()[:12]))
        for owner in ("parameter/layer0.weight", "optimizer/", "gradient/"):
            if owner not in out:
                print(f"FAIL: the memory flame-graph input lacks {owner!r}")
                return 1
        # torch 2.x's dict layout is written too and loads as a dict
        p = subprocess.run([py, conv, os.path.join(d, "mem.json"), pk, "--format", "dict"], capture_output=True, text=True)
        if p.returncode or not isinstance(pickle.load(open(pk, "rb")), dict):
            print("FAIL: --format dict")
            return 1
        bad = os.path.join(d, "bad.json")
        open(bad, "w").write("{\"segments\": 3")
        p = subprocess.run([py, conv, bad, pk], capture_output=True, text=True)
        if p.returncode != 2 or "is not a readable ebb snapshot" not in p.stderr:
            print("FAIL: a malformed snapshot was not refused with exit code 2:", p.returncode, p.stderr)
            return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
