#!/usr/bin/python3
"""record-traces.py: records allocation traces of real PyTorch training runs for ebb-alloc-replay.

Each model is trained on the CPU for a few steps with Adam or SGD with momentum (optimizer state
lives across steps),
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
                                            [--out perf/traces] [--models mlp,cnn,...]

Needs Debian's python3-torch (1.13, CPU) for /usr/bin/python3, and the tracer built
(`cmake --build build/default --target ebb-alloc-tracer`). Two intra-op threads.
"""
import argparse
import gzip
import os
import subprocess
import sys
import tempfile

MODELS = ("mlp", "cnn", "transformer", "lstm", "gpt_varlen", "resnet", "unet", "gru_packed", "finetune",
          "accum")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ---- the models (run in the traced child) -----------------------------------------------------

def build(name, torch):
    """Returns (model, batch(step) -> (input, target), loss_fn, steps, description), or the same
    with a sixth item, a dict of what differs from the plain loop: "opt" (params -> optimizer;
    default Adam at 1e-3 over every parameter that requires grad), "micro" (backward passes per
    optimizer step, each with its own batch(step, k); default 1)."""
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

    if name == "gpt_varlen":
        # Larger than "transformer", and each step's sequence length differs (packed batches of
        # documents cut to the longest in the batch), so every activation changes size per step.
        vocab, d, heads, layers, bs = 8192, 384, 6, 6, 8
        lengths = (96, 160, 64, 128, 192, 80, 144, 112)

        class GPT(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(vocab, d)
                self.pos = nn.Parameter(torch.zeros(max(lengths), d))
                layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True, norm_first=True,
                                                   activation="gelu")
                self.enc = nn.TransformerEncoder(layer, layers)
                self.norm = nn.LayerNorm(d)
                self.head = nn.Linear(d, vocab, bias=False)

            def forward(self, x):
                t = x.shape[1]
                mask = torch.triu(torch.full((t, t), float("-inf")), 1)
                h = self.enc(self.emb(x) + self.pos[:t], mask=mask)
                return self.head(self.norm(h)).reshape(-1, vocab)

        def batch(step):
            tok = torch.randint(0, vocab, (bs, lengths[step % len(lengths)] + 1))
            return tok[:, :-1].contiguous(), tok[:, 1:].reshape(-1)

        return (GPT(), batch, nn.CrossEntropyLoss(), len(lengths),
                "GPT-style LM, 6 layers d 384, 6 heads, GELU, seq 64-192 by step, batch 8, vocab 8192; AdamW",
                {"opt": lambda p: torch.optim.AdamW(p, lr=3e-4, weight_decay=0.1)})

    if name == "resnet":
        # Residual blocks (identity or 1x1 projection shortcuts) with batch norm, SGD with momentum.
        class Basic(nn.Module):
            def __init__(self, cin, cout, stride):
                super().__init__()
                self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
                self.b1 = nn.BatchNorm2d(cout)
                self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
                self.b2 = nn.BatchNorm2d(cout)
                self.short = (nn.Sequential() if stride == 1 and cin == cout else
                              nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

            def forward(self, x):
                h = torch.relu(self.b1(self.c1(x)))
                return torch.relu(self.b2(self.c2(h)) + self.short(x))

        stages, cin, mods = (32, 64, 128, 256), 32, []
        for i, c in enumerate(stages):
            mods += [Basic(cin, c, 1 if i == 0 else 2), Basic(c, c, 1)]
            cin = c
        model = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), *mods,
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 100))

        def batch(step):
            return torch.randn(32, 3, 32, 32), torch.randint(0, 100, (32,))

        return (model, batch, nn.CrossEntropyLoss(), 6,
                "ResNet-18-style, 4 stages 32-256 of 2 basic blocks with batch norm, 32x32 images, batch 32; SGD momentum",
                {"opt": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=5e-4)})

    if name == "unet":
        # Encoder-decoder whose decoder concatenates the encoder's maps at each scale (skip
        # connections keep every encoder activation live until the decoder used it).
        def conv2(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

        class UNet(nn.Module):
            def __init__(self, ch=(16, 32, 64, 128)):
                super().__init__()
                self.down = nn.ModuleList()
                cin = 3
                for c in ch:
                    self.down.append(conv2(cin, c))
                    cin = c
                self.mid = conv2(ch[-1], 2 * ch[-1])
                self.up = nn.ModuleList()
                self.dec = nn.ModuleList()
                cin = 2 * ch[-1]
                for c in reversed(ch):
                    self.up.append(nn.ConvTranspose2d(cin, c, 2, 2))
                    self.dec.append(conv2(2 * c, c))
                    cin = c
                self.out = nn.Conv2d(ch[0], 5, 1)

            def forward(self, x):
                skips = []
                for m in self.down:
                    x = m(x)
                    skips.append(x)
                    x = torch.max_pool2d(x, 2)
                x = self.mid(x)
                for up, dec, s in zip(self.up, self.dec, reversed(skips)):
                    x = dec(torch.cat([up(x), s], 1))
                return self.out(x)

        def batch(step):
            return torch.randn(4, 3, 96, 96), torch.randint(0, 5, (4, 96, 96))

        return UNet(), batch, nn.CrossEntropyLoss(), 5, "U-Net 16-32-64-128 with concatenated skips, 96x96 images, 5 classes per pixel, batch 4"

    if name == "gru_packed":
        # Variable-length sequences through pack_padded_sequence: each step's batch has its own
        # lengths, so the packed buffers and the gates' workspaces change size every step.
        vocab, d, hidden, bs, classes = 8192, 192, 384, 32, 20
        g = torch.Generator().manual_seed(1)

        class Clf(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(vocab, d)
                self.rnn = nn.GRU(d, hidden, 2, batch_first=True, bidirectional=True)
                self.head = nn.Linear(2 * hidden, classes)

            def forward(self, xl):
                x, lengths = xl
                packed = nn.utils.rnn.pack_padded_sequence(self.emb(x), lengths, batch_first=True, enforce_sorted=False)
                _, h = self.rnn(packed)
                return self.head(torch.cat([h[-2], h[-1]], 1))

        def batch(step):
            lengths = torch.randint(8, 24 + 12 * (step % 4), (bs,), generator=g)
            x = torch.randint(1, vocab, (bs, int(lengths.max())), generator=g)
            return (x, lengths), torch.randint(0, classes, (bs,), generator=g)

        return (Clf(), batch, nn.CrossEntropyLoss(), 8,
                "bidirectional GRU classifier, 2 layers hidden 384, packed sequences of 8-59 tokens, batch 32",
                {"opt": lambda p: torch.optim.Adam(p, lr=1e-3)})

    if name == "finetune":
        # A frozen backbone (no gradients, no optimizer state) under a trained head: the backward
        # stops at the head, and the backbone's activations are freed as the forward goes.
        vocab, d, seq, bs, classes = 8192, 256, 128, 16, 4

        class Tuned(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(vocab, d)
                layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True)
                self.backbone = nn.TransformerEncoder(layer, 4)
                top = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True)
                self.top = nn.TransformerEncoder(top, 1)  # the one encoder layer trained
                self.head = nn.Sequential(nn.Linear(d, 512), nn.GELU(), nn.Linear(512, classes))
                for p in list(self.emb.parameters()) + list(self.backbone.parameters()):
                    p.requires_grad_(False)

            def forward(self, x):
                return self.head(self.top(self.backbone(self.emb(x))).mean(1))

        def batch(step):
            return torch.randint(0, vocab, (bs, seq)), torch.randint(0, classes, (bs,))

        return (Tuned(), batch, nn.CrossEntropyLoss(), 8,
                "fine-tuning: frozen embedding and 4 encoder layers d 256, one trained layer and an MLP head, seq 128, batch 16",
                {"opt": lambda p: torch.optim.AdamW(p, lr=1e-4)})

    if name == "accum":
        # Gradient accumulation: four micro-batches' backward passes add into .grad before each
        # optimizer step, so the gradients stay live through the forward passes between.
        vocab, d, seq, bs = 4096, 256, 96, 4

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(vocab, d)
                self.rnn = nn.Conv1d(d, d, 5, padding=2)
                layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
                self.enc = nn.TransformerEncoder(layer, 3)
                self.head = nn.Linear(d, vocab)

            def forward(self, x):
                h = self.emb(x)
                h = h + self.rnn(h.transpose(1, 2)).transpose(1, 2)
                return self.head(self.enc(h)).reshape(-1, vocab)

        def batch(step, k=0):
            tok = torch.randint(0, vocab, (bs, seq + 1))
            return tok[:, :-1].contiguous(), tok[:, 1:].reshape(-1)

        return (LM(), batch, nn.CrossEntropyLoss(), 5,
                "LM with a conv and 3 encoder layers d 256, seq 96, micro-batch 4, 4 micro-batches per step",
                {"opt": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), "micro": 4})

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
    built = build(name, torch)
    model, batch, loss_fn, steps, desc = built[:5]
    extra = built[5] if len(built) > 5 else {}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = extra["opt"](params) if "opt" in extra else torch.optim.Adam(params, lr=1e-3)
    micro = extra.get("micro", 1)
    tracer.ebb_alloc_tracer_mark(f"model {name}: {desc}; {type(opt).__name__}; torch {torch.__version__} "
                                 "(Debian python3-torch), 2 threads".encode())
    model.train()
    for step in range(steps):
        tracer.ebb_alloc_tracer_mark(f"step {step}".encode())
        for k in range(micro):
            x, y = batch(step, k) if micro > 1 else batch(step)
            if k == 0:
                opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            (loss / micro if micro > 1 else loss).backward()
        opt.step()
        loss = loss.item()
        del x, y
    tracer.ebb_alloc_tracer_mark(f"end: the parameters, gradients and {type(opt).__name__} state are still live (loss {loss:.3f})".encode())
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
