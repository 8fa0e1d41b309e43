#!/usr/bin/env python3
"""check_gen_trace.py: tools/gen-alloc-trace.py makes traces shaped like training steps.

For each model and stream count, a short trace must: use only `a <id> <bytes> [<stream>]`, `f <id>`
and `#` lines; free only live ids; and leave live at its end only what a training loop keeps
(parameters, before the first step; gradients and optimizer moments, made in the first step).
Nothing allocated in a later step may outlive that step: such a block piles up step after step and
the arena must grow for it, which reads as fragmentation or as a steady state never reached.
usage: check_gen_trace.py GENERATOR
"""
import subprocess
import sys


def check(gen, args):
    out = subprocess.run([sys.executable, gen] + args, check=True, capture_output=True, text=True).stdout
    live, step, where = {}, -1, " ".join(args)
    for n, line in enumerate(out.splitlines(), 1):
        f = line.split()
        if not f:
            continue
        if f[0] == "#":
            if len(f) > 2 and f[1] == "step":
                step = int(f[2])
            continue
        if f[0] == "a" and len(f) in (3, 4):
            if f[1] in live:
                sys.exit(f"{where}: line {n}: id {f[1]} allocated while live")
            live[f[1]] = (step, int(f[2]))
        elif f[0] == "f" and len(f) == 2:
            if f[1] not in live:
                sys.exit(f"{where}: line {n}: free of id {f[1]}, which is not live")
            del live[f[1]]
        else:
            sys.exit(f"{where}: line {n}: unexpected line '{line}'")
    if step < 2:
        sys.exit(f"{where}: expected at least 3 steps, saw {step + 1}")
    late = sorted((s, b) for s, b in live.values() if s >= 1)
    if late:
        sys.exit(f"{where}: {len(late)} blocks allocated in steps >= 1 are never freed "
                 f"(first: step {late[0][0]}, {late[0][1]} bytes); expected only parameters, "
                 f"gradients and optimizer state to stay live")
    print(f"ok: {where}: {len(live)} blocks live at the end, all from before or in step 0")


def main():
    gen = sys.argv[1]
    for model in ("mlp", "transformer"):
        for streams in ("1", "2", "3"):
            check(gen, ["--model", model, "--layers", "3", "--steps", "4", "--hidden", "256",
                        "--heads", "4", "--vocab", "1024", "--batch", "2,4", "--seqlen", "32,64",
                        "--streams", streams, "--bucket-mb", "1", "--seed", "3"])


if __name__ == "__main__":
    main()
