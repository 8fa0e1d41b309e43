#!/usr/bin/env python3
"""gen-alloc-trace.py: synthetic allocation traces shaped like training steps, for ebb-alloc-replay.

The trace follows what a training loop asks of a caching device allocator:
  * parameters (fp32) allocated once on stream 0, before the first step;
  * per step, a forward pass whose batch size (and, for the transformer, sequence length) is drawn
    from the given lists, so activation sizes change step to step as with variable-length batches;
    saved activations live until backward, workspaces (attention scores, residual temporaries)
    are freed at once;
  * a backward pass in reverse layer order: each saved activation is freed as its gradient is
    produced; weight gradients are allocated and kept on the first step and, on later steps,
    produced in a temporary that is accumulated into the kept gradient and freed;
  * with --streams >= 2, gradient buckets (about --bucket-mb each) are copied for communication on
    stream 1 and freed two layers later, as an all-reduce in flight; with --streams >= 3, each
    layer's weights are prefetched (gathered, bf16) on stream 2 one layer ahead and freed after use;
  * an optimizer (Adam): moments allocated once on the first step, per-parameter temporaries
    allocated and freed every step, and a few tiny grad-norm scalars.

Output (stdout): `a <id> <bytes> [<stream>]` and `f <id>` lines, with `#` comments naming the step.
Deterministic for a given command line (--seed). Python 3 standard library only.
"""
import argparse
import random
import sys

BF16 = 2
FP32 = 4


class Trace:
    """Collects the events; ids are sequential from --id-base (ids never repeat)."""

    def __init__(self, id_base):
        self.lines = []
        self.next_id = id_base
        self.live = {}

    def alloc(self, nbytes, stream=0):
        i = self.next_id
        self.next_id += 1
        self.live[i] = nbytes
        self.lines.append(f"a {i} {nbytes} {stream}" if stream else f"a {i} {nbytes}")
        return i

    def free(self, i):
        del self.live[i]
        self.lines.append(f"f {i}")

    def comment(self, text):
        self.lines.append(f"# {text}")


def layer_params(model, h):
    """The weight matrices (and vectors) of one layer, as element counts, in forward order."""
    if model == "mlp":
        return [h * h, h]  # weight, bias
    # transformer block: ln1, qkv, proj, ln2, fc1, fc2 (biases folded into vectors)
    return [2 * h, 3 * h * h + 3 * h, h * h + h, 2 * h, 4 * h * h + 4 * h, 4 * h * h + h]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["mlp", "transformer"], default="transformer")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192, help="output width of the last layer")
    ap.add_argument("--batch", default="32", help="batch sizes drawn per step, comma-separated")
    ap.add_argument("--seqlen", default="512",
                    help="transformer: sequence lengths drawn per step, comma-separated")
    ap.add_argument("--streams", type=int, default=1, choices=[1, 2, 3],
                    help="1: all on stream 0; 2: + comm buckets on stream 1; 3: + prefetch on 2")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--id-base", type=int, default=0, help="first id (ids go up to 2^63)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.layers < 1 or a.steps < 1 or a.hidden < 1 or a.heads < 1 or a.hidden % a.heads:
        ap.error("--layers, --steps, --hidden, --heads must be positive, hidden divisible by heads")
    batches = [int(x) for x in a.batch.split(",")]
    seqlens = [int(x) for x in a.seqlen.split(",")] if a.model == "transformer" else [1]

    rng = random.Random(a.seed)
    t = Trace(a.id_base)
    h, L = a.hidden, a.layers
    t.comment("gen-alloc-trace.py " + " ".join(sys.argv[1:]))

    # Parameters: fp32, stream 0, once.
    params = []  # per layer: list of (param elements)
    for _ in range(L):
        params.append(layer_params(a.model, h))
        for n in params[-1]:
            t.alloc(n * FP32)
    head = h * a.vocab
    t.alloc(head * FP32)
    all_params = [n for lp in params for n in lp] + [head]

    grads = None  # kept fp32 gradients, allocated on the first step
    adam = None
    comm_stream = 1 if a.streams >= 2 else 0
    pref_stream = 2 if a.streams >= 3 else 0
    bucket_bytes = int(a.bucket_mb * (1 << 20))

    for step in range(a.steps):
        b = rng.choice(batches)
        s = rng.choice(seqlens)
        tok = b * s
        t.comment(f"step {step} batch {b} seqlen {s} tokens {tok}")

        # ---- forward ----
        x = t.alloc(tok * h * BF16)  # input embedding / batch
        saved = []  # per layer: list of saved activation ids
        prefetch = {}  # layer -> gathered weights (stream 2)

        def gather(layer):
            if a.streams >= 3 and layer < L:
                prefetch[layer] = t.alloc(sum(params[layer]) * BF16, pref_stream)

        gather(0)
        for layer in range(L):
            gather(layer + 1)  # one layer ahead
            keep = [x]
            if a.model == "mlp":
                y = t.alloc(tok * h * FP32)  # linear out
                r = t.alloc(tok * h * FP32)  # relu out
                t.free(y)
                x = r
            else:
                ln1 = t.alloc(tok * h * BF16)
                qkv = t.alloc(tok * 3 * h * BF16)
                scores = t.alloc(b * a.heads * s * s * BF16)  # workspace
                probs = t.alloc(b * a.heads * s * s * BF16)
                t.free(scores)
                att = t.alloc(tok * h * BF16)
                proj = t.alloc(tok * h * BF16)  # residual temporary
                x1 = t.alloc(tok * h * BF16)
                t.free(proj)
                ln2 = t.alloc(tok * h * BF16)
                fc1 = t.alloc(tok * 4 * h * BF16)
                act = t.alloc(tok * 4 * h * BF16)
                fc2 = t.alloc(tok * h * BF16)
                x2 = t.alloc(tok * h * BF16)
                t.free(fc2)
                keep += [ln1, qkv, probs, att, x1, ln2, fc1, act]
                x = x2
            saved.append(keep)
            if layer in prefetch:
                t.free(prefetch.pop(layer))
        logits = t.alloc(tok * a.vocab * BF16)
        loss = t.alloc(FP32 * b)
        dlogits = t.alloc(tok * a.vocab * BF16)
        t.free(loss)
        t.free(logits)

        # ---- backward ----
        first = grads is None
        if first:
            grads = []
        gi = len(all_params) - 1  # walk parameters in reverse
        pending = 0  # gradient bytes not yet bucketed
        in_flight = []  # (bucket id, layers left until freed)
        dx = t.alloc(tok * h * BF16)
        t.free(dlogits)

        def weight_grad(n):
            nonlocal gi, pending
            if first:
                grads.append(t.alloc(n * FP32))
            else:
                tmp = t.alloc(n * BF16)  # produced, accumulated into the kept fp32 gradient
                t.free(tmp)
            gi -= 1
            pending += n * FP32

        weight_grad(head)
        t.free(x)  # the last layer's output: the head's input, saved for its weight gradient
        if a.streams >= 3:
            prefetch[L - 1] = t.alloc(sum(params[L - 1]) * BF16, pref_stream)
        for layer in reversed(range(L)):
            if a.streams >= 3 and layer - 1 >= 0:
                prefetch[layer - 1] = t.alloc(sum(params[layer - 1]) * BF16, pref_stream)
            for n in reversed(params[layer]):
                weight_grad(n)
            # activation gradients: one new gradient per saved tensor, freed as we go
            for act_id in reversed(saved[layer]):
                nbytes = t.live[act_id]
                d = t.alloc(max(nbytes, tok * h * BF16))
                t.free(dx)
                t.free(act_id)
                dx = d
            if layer in prefetch:
                t.free(prefetch.pop(layer))
            # buckets in flight finish two layers later
            for entry in in_flight:
                entry[1] -= 1
            for entry in [e for e in in_flight if e[1] <= 0]:
                t.free(entry[0])
                in_flight.remove(entry)
            if pending >= bucket_bytes:
                in_flight.append([t.alloc(pending, comm_stream), 2])
                pending = 0
        if pending:
            in_flight.append([t.alloc(pending, comm_stream), 0])
        for bid, _ in in_flight:
            t.free(bid)
        t.free(dx)

        # ---- optimizer (Adam) ----
        if adam is None:
            adam = [t.alloc(n * FP32) for n in all_params for _ in range(2)]
        norms = [t.alloc(FP32) for _ in range(min(8, len(all_params)))]
        for n in all_params:
            tmp = t.alloc(n * FP32)  # m / sqrt(v) update
            t.free(tmp)
        for i in norms:
            t.free(i)

    sys.stdout.write("\n".join(t.lines) + "\n")


if __name__ == "__main__":
    main()
