#!/usr/bin/env python3
"""ebb-snapshot-to-torch: an ebb memory snapshot (ebb_memory_snapshot_json, ebb-train's mem.json)
as the pickle PyTorch's torch.cuda._memory_viz reads.

usage: ebb-snapshot-to-torch.py SNAPSHOT.json OUT.pickle [--format list|dict]

torch 1.13 (Debian 12's python3-torch) expects a list of segments (`--format list`, the default);
torch 2.x a dict {"segments": [...], "device_traces": [...]} (`--format dict`). Every block gets
one history entry whose single frame names its ebb owner ("<category>/<name>", file "ebb"), so
the viewers' flame graphs group memory by owner where PyTorch's would show Python frames. The
device lists only: pinned and host pools are ebb's own and have no counterpart in PyTorch.

Exit codes: 0 written, 2 a snapshot that cannot be read or is not ebb's (the message says why).
"""
import argparse
import json
import pickle
import sys


def owner_frame(block):
    o = block.get("owner") or {}
    name = o.get("name") or "(no owner scope)"
    return {"filename": "ebb", "line": 0, "name": f"{o.get('category', 'other')}/{name}"}


def convert_segment(seg):
    blocks = []
    for b in seg["blocks"]:
        out = {"address": b["address"], "size": b["size"], "requested_size": b.get("requested_size", 0),
               "state": b["state"]}
        if b["state"] != "inactive":
            out["history"] = [{"addr": b["address"], "real_size": b.get("requested_size") or b["size"],
                               "frames": [owner_frame(b)]}]
        blocks.append(out)
    return {"device": seg["device"], "address": seg["address"], "total_size": seg["total_size"],
            "allocated_size": seg["allocated_size"], "active_size": seg["active_size"],
            "requested_size": seg.get("requested_size", 0), "stream": seg["stream"],
            "segment_type": seg["segment_type"], "blocks": blocks}


def convert_trace(entry):
    return {"action": entry["action"], "addr": entry["addr"], "size": entry["size"],
            "stream": entry["stream"], "frames": [owner_frame(entry)]}


def main(argv):
    ap = argparse.ArgumentParser(prog="ebb-snapshot-to-torch.py",
                                 description="An ebb memory snapshot as PyTorch's snapshot pickle.")
    ap.add_argument("snapshot", help="ebb's snapshot JSON (mem.json)")
    ap.add_argument("output", help="the pickle to write")
    ap.add_argument("--format", choices=("list", "dict"), default="list",
                    help="list: torch 1.13's list of segments (default); dict: torch 2.x's")
    args = ap.parse_args(argv[1:])
    try:
        with open(args.snapshot) as f:
            snap = json.load(f)
        segments = [convert_segment(s) for s in snap["segments"]]
        traces = [[convert_trace(e) for e in dev] for dev in snap["device_traces"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"ebb-snapshot-to-torch: '{args.snapshot}' is not a readable ebb snapshot: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 2
    data = segments if args.format == "list" else {"segments": segments, "device_traces": traces}
    try:
        with open(args.output, "wb") as f:
            pickle.dump(data, f)
    except OSError as e:
        print(f"ebb-snapshot-to-torch: cannot write '{args.output}': {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
