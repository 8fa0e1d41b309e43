#!/usr/bin/python3
"""record-traces.py: records allocation traces of real PyTorch training runs for ebb-alloc-replay.

Each model is trained on the CPU for a few steps with Adam (optimizer state lives across steps),
in a child process run under the allocation tracer (tools/alloc-tracer.c, LD_PRELOAD): every heap
block of 4 KiB or more that the run allocates from building the model to the last step is
recorded, with a `# step N` comment at the start of each step. On the CPU, PyTorch takes each
tensor's storage from posix_memalign and gives it back with free, so the tracer records that call
only (EBB_ALLOC_TRACE_CALLS=posix_memalign): the trace is the sequence of tensor allocations a
caching device allocator would see, in the order the run made them. Left out: OpenBLAS's 512 KiB
job array malloc'ed per threaded GEMM (72% of the transformer's blocks of 4 KiB or more) and the
interpreter's own blocks (a handful), which no device allocator sees.

Writes <out>/real_<model>.trace.gz (gzip with no time stamp, so a re-recording that finds the
same sequence writes the same file) and prints a line of statistics per trace.

    /usr/bin/python3 tools/record-traces.py [--tracer build/default/lib/libebb-alloc-tracer.so]
                                            [--out perf/traces] [--models mlp,cnn,transformer,lstm]

Needs Debian's python3-torch (1.13, CPU) for /usr/bin/python3, and the tracer built
(`cmake --build build/default --target ebb-alloc-tracer`). Two intra-op threads.
"""
import argparse
import gzip
import os
import subprocess
import sys
import tempfile

MODELS = ("mlp", "cnn", "transformer", "lstm")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ---- the models (run in the traced child) -----------------------------------------------------

def build(name, torch):
    """Returns (model, batch(step) -> (input, target), loss_fn, steps, description)."""
    nn = torch.nn
    if name == "mlp":
        # 4 hidden layers of 1024 at batch 256: each activation is exactly 1 MiB.
        layers = []
        width = 1024
        for _ in range(4):
            layers += [nn.Linear(width, width), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(width, 10))

        def batch(step):
            return torch.randn(256, width), torch.randint(0, 10, (256,))

        return model, batch, nn.CrossEntropyLoss(), 10, "MLP 1024x4, batch 256"

    if name == "cnn":
        def block(cin, cout, stride):
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            block(32, 32, 1), block(32, 64, 2), block(64, 128, 2),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))

        def batch(step):
            return torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))

        return model, batch, nn.CrossEntropyLoss(), 8, "CNN 32-64-128 with batch norm, 32x32 images, batch 32"

    if name == "transformer":
        vocab, d, seq, bs = 4096, 256, 128, 8

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(vocab, d)
                self.pos = nn.Parameter(torch.zeros(seq, d))
                layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
                self.enc = nn.TransformerEncoder(layer, 4)
                self.norm = nn.LayerNorm(d)
                self.head = nn.Linear(d, vocab)
                self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1))

            def forward(self, x):
                h = self.enc(self.emb(x) + self.pos, mask=self.mask)
                return self.head(self.norm(h)).reshape(-1, vocab)

        def batch(step):
            tok = torch.randint(0, vocab, (bs, seq + 1))
            return tok[:, :-1].contiguous(), tok[:, 1:].reshape(-1)

        return LM(), batch, nn.CrossEntropyLoss(), 6, "transformer LM, 4 layers d 256, 4 heads, seq 128, batch 8, vocab 4096"

    if name == "lstm":
        vocab, d, hidden, bs = 4096, 256, 512, 32
        lengths = (48, 64, 32, 64, 48, 32, 64, 48)  # bucketed batches: the length changes per step

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(vocab, d)
                self.rnn = nn.LSTM(d, hidden, 2, batch_first=True)
                self.head = nn.Linear(hidden, vocab)

            def forward(self, x):
                h, _ = self.rnn(self.emb(x))
                return self.head(h).reshape(-1, vocab)

        def batch(step):
            tok = torch.randint(0, vocab, (bs, lengths[step % len(lengths)] + 1))
            return tok[:, :-1].contiguous(), tok[:, 1:].reshape(-1)

        return LM(), batch, nn.CrossEntropyLoss(), len(lengths), "LSTM LM, 2 layers hidden 512, batch 32, seq 32/48/64 by step, vocab 4096"

    raise SystemExit(f"record-traces.py: unknown model '{name}'; expected one of {', '.join(MODELS)}")


def child(name, tracer_path):
    import ctypes
    import torch

    tracer = ctypes.CDLL(tracer_path)  # the preloaded copy: its pause/mark/stop act on the trace
    if not tracer.ebb_alloc_tracer_active():
        raise SystemExit("record-traces.py: the tracer is not active (LD_PRELOAD and EBB_ALLOC_TRACE unset?)")
    torch.set_num_threads(2)
    torch.manual_seed(0)
    # Everything before this (the interpreter, importing torch) stayed out of the trace: the child
    # started paused. From here on the trace holds what a device allocator would see, parameters
    # first.
    tracer.ebb_alloc_tracer_resume()
    model, batch, loss_fn, steps, desc = build(name, torch)
    tracer.ebb_alloc_tracer_mark(f"model {name}: {desc}; Adam; torch {torch.__version__} (Debian python3-torch), 2 threads".encode())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for step in range(steps):
        tracer.ebb_alloc_tracer_mark(f"step {step}".encode())
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        loss = loss.item()
        del x, y
    tracer.ebb_alloc_tracer_mark(f"end: the parameters, gradients and Adam state are still live (loss {loss:.3f})".encode())
    tracer.ebb_alloc_tracer_stop()


# ---- recording and statistics (the parent) -----------------------------------------------------

def stats(lines):
    """Allocations, peak live bytes, steps, distinct sizes and the shares of 1 MiB / 4 MiB blocks."""
    live, cur, peak, nalloc, steps = {}, 0, 0, 0, 0
    sizes = {}
    for line in lines:
        if line.startswith("# step "):
            steps += 1
        f = line.split("#", 1)[0].split()
        if not f:
            continue
        if f[0] == "a":
            b = int(f[2])
            live[f[1]] = b
            cur += b
            peak = max(peak, cur)
            nalloc += 1
            sizes[b] = sizes.get(b, 0) + 1
        elif f[0] == "f":
            cur -= live.pop(f[1])
    share = lambda b: sizes.get(b, 0) / nalloc if nalloc else 0.0
    return (f"allocs={nalloc} peak_live_mib={peak / 2**20:.1f} steps={steps} distinct_sizes={len(sizes)} "
            f"share_1mib={share(1 << 20):.3f} share_4mib={share(4 << 20):.3f} "
            f"live_at_end_mib={cur / 2**20:.1f}")


def record(name, tracer, out_dir):
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace")
        env = dict(os.environ, LD_PRELOAD=tracer, EBB_ALLOC_TRACE=raw, EBB_ALLOC_TRACE_PAUSED="1",
                   EBB_ALLOC_TRACE_CALLS="posix_memalign", OMP_NUM_THREADS="2")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, "--tracer", tracer],
                       env=env, check=True)
        with open(raw) as f:
            lines = f.read().splitlines()
    head = [f"# real_{name}: recorded by tools/record-traces.py --models {name} "
            "(libebb-alloc-tracer under python3-torch, CPU)"]
    text = "\n".join(head + lines) + "\n"
    path = os.path.join(out_dir, f"real_{name}.trace.gz")
    with open(path, "wb") as f:
        with gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=9) as z:
            z.write(text.encode())
    print(f"trace=real_{name} {stats(lines)} gz_bytes={os.path.getsize(path)}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tracer", default=os.path.join(ROOT, "build/default/lib/libebb-alloc-tracer.so"))
    ap.add_argument("--out", default=os.path.join(ROOT, "perf/traces"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    tracer = os.path.abspath(a.tracer)
    if a.child:
        child(a.child, tracer)
        return
    if not os.path.exists(tracer):
        raise SystemExit(f"record-traces.py: no tracer at {tracer}; build it: "
                         "cmake --build build/default --target ebb-alloc-tracer")
    for name in a.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"record-traces.py: unknown model '{name}'; expected one of {', '.join(MODELS)}")
        record(name, tracer, a.out)


if __name__ == "__main__":
    main()
