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

# The last five were added after the arena's placement was chosen on the first ten, to judge it on
# traces it never saw (perf/frag.sh names the sets).
MODELS = ("mlp", "cnn", "transformer", "lstm", "gpt_varlen", "resnet", "unet", "gru_packed", "finetune",
          "accum", "vae", "tcn", "moe", "seq2seq", "vit")
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

    if name == "vae":
        # A convolutional variational autoencoder: the encoder's mean and log-variance, a sampled
        # latent, a decoder of transposed convolutions, and a loss of reconstruction plus KL term.
        class VAE(nn.Module):
            def __init__(self, z=128):
                super().__init__()
                self.enc = nn.Sequential(
                    nn.Conv2d(3, 32, 4, 2, 1), nn.LeakyReLU(0.2),
                    nn.Conv2d(32, 64, 4, 2, 1), nn.BatchNorm2d(64), nn.LeakyReLU(0.2),
                    nn.Conv2d(64, 128, 4, 2, 1), nn.BatchNorm2d(128), nn.LeakyReLU(0.2),
                    nn.Conv2d(128, 256, 4, 2, 1), nn.BatchNorm2d(256), nn.LeakyReLU(0.2), nn.Flatten())
                self.mu = nn.Linear(256 * 4 * 4, z)
                self.logvar = nn.Linear(256 * 4 * 4, z)
                self.fc = nn.Linear(z, 256 * 4 * 4)
                self.dec = nn.Sequential(
                    nn.ConvTranspose2d(256, 128, 4, 2, 1), nn.BatchNorm2d(128), nn.ReLU(),
                    nn.ConvTranspose2d(128, 64, 4, 2, 1), nn.BatchNorm2d(64), nn.ReLU(),
                    nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.BatchNorm2d(32), nn.ReLU(),
                    nn.ConvTranspose2d(32, 3, 4, 2, 1), nn.Sigmoid())

            def forward(self, x):
                h = self.enc(x)
                mu, logvar = self.mu(h), self.logvar(h)
                zs = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
                return self.dec(self.fc(zs).view(-1, 256, 4, 4)), mu, logvar

        def loss(out, x):
            recon, mu, logvar = out
            kl = -0.5 * torch.mean(torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), 1))
            return nn.functional.binary_cross_entropy(recon, x, reduction="sum") / x.shape[0] + kl

        def batch(step):
            x = torch.rand(32, 3, 64, 64)
            return x, x

        return VAE(), batch, loss, 8, "convolutional VAE, encoder 32-256 and transposed-conv decoder, latent 128, 64x64 images, batch 32"

    if name == "tcn":
        # A temporal convolutional network over sequences: dilated causal 1-D convolutions (1 to
        # 32) with weight norm (each weight recomputed per forward), dropout and residuals, a
        # label per time step; each step's sequence length differs.
        lengths = (512, 384, 640, 448, 576, 320, 704, 512)
        feats, ch, classes, bs = 40, 128, 32, 8

        class Block(nn.Module):
            def __init__(self, cin, cout, dil):
                super().__init__()
                self.pad = 2 * dil
                wn = nn.utils.weight_norm
                self.c1 = wn(nn.Conv1d(cin, cout, 3, padding=self.pad, dilation=dil))
                self.c2 = wn(nn.Conv1d(cout, cout, 3, padding=self.pad, dilation=dil))
                self.drop = nn.Dropout(0.1)
                self.down = nn.Conv1d(cin, cout, 1) if cin != cout else None

            def forward(self, x):
                h = self.drop(torch.relu(self.c1(x)[:, :, :-self.pad].contiguous()))
                h = self.drop(torch.relu(self.c2(h)[:, :, :-self.pad].contiguous()))
                return torch.relu(h + (x if self.down is None else self.down(x)))

        class TCN(nn.Module):
            def __init__(self):
                super().__init__()
                blocks, cin = [], feats
                for i in range(6):
                    blocks.append(Block(cin, ch, 2 ** i))
                    cin = ch
                self.net = nn.Sequential(*blocks)
                self.head = nn.Conv1d(ch, classes, 1)

            def forward(self, x):
                return self.head(self.net(x))

        def batch(step):
            t = lengths[step % len(lengths)]
            return torch.randn(bs, feats, t), torch.randint(0, classes, (bs, t))

        return (TCN(), batch, nn.CrossEntropyLoss(), len(lengths),
                "TCN, 6 residual blocks of dilated causal Conv1d (dilation 1-32) 128 channels with weight norm and "
                "dropout 0.1, 40 features, seq 320-704 by step, a label per step, batch 8",
                {"opt": lambda p: torch.optim.Adam(p, lr=2e-3)})

    if name == "moe":
        # Mixture-of-experts MLP blocks: a softmax gate routes each token to its top 2 of 8 experts,
        # so how many tokens each expert takes (and the size of its activations) changes per
        # layer and per step; a load-balancing term joins the loss.
        vocab, d, hidden, experts, k, seq, bs = 4096, 256, 1024, 8, 2, 64, 32

        class MoE(nn.Module):
            def __init__(self):
                super().__init__()
                self.norm = nn.LayerNorm(d)
                self.gate = nn.Linear(d, experts, bias=False)
                self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
                                             for _ in range(experts))

            def forward(self, x):
                h = self.norm(x)
                probs = torch.softmax(self.gate(h), -1)
                top, idx = probs.topk(k, -1)
                top = top / top.sum(-1, keepdim=True)
                out = torch.zeros_like(h)
                for e, expert in enumerate(self.experts):
                    tok, slot = (idx == e).nonzero(as_tuple=True)
                    if tok.numel():
                        out.index_add_(0, tok, expert(h[tok]) * top[tok, slot].unsqueeze(1))
                share = torch.zeros(experts).index_add_(0, idx.reshape(-1), torch.ones(idx.numel())) / idx.numel()
                self.aux = experts * torch.sum(share * probs.mean(0))
                return x + out

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(vocab, d)
                self.blocks = nn.ModuleList(MoE() for _ in range(3))
                self.norm = nn.LayerNorm(d)
                self.head = nn.Linear(d, vocab)

            def forward(self, x):
                h = self.emb(x).reshape(-1, d)
                for b in self.blocks:
                    h = b(h)
                return self.head(self.norm(h)), sum(b.aux for b in self.blocks)

        def loss(out, y):
            logits, aux = out
            return nn.functional.cross_entropy(logits, y) + 0.01 * aux

        def batch(step):
            tok = torch.randint(0, vocab, (bs, seq + 1))
            return tok[:, :-1].contiguous(), tok[:, 1:].reshape(-1)

        return (Net(), batch, loss, 8,
                "mixture-of-experts LM, 3 blocks of 8 GELU experts d 256 hidden 1024 with top-2 gating and a "
                "load-balancing term, seq 64, batch 32, vocab 4096",
                {"opt": lambda p: torch.optim.AdamW(p, lr=5e-4)})

    if name == "seq2seq":
        # An encoder-decoder with attention: a bidirectional GRU encoder, and a GRU cell decoder
        # stepped token by token in Python under teacher forcing, attending over the encoder's
        # outputs at each step (Luong, general score); source and target lengths change per step.
        vocab, d, hidden, bs = 6000, 256, 512, 32
        lengths = ((24, 22), (36, 30), (18, 20), (30, 34), (40, 26), (22, 28), (32, 38), (28, 24))

        class S2S(nn.Module):
            def __init__(self):
                super().__init__()
                self.src_emb = nn.Embedding(vocab, d)
                self.tgt_emb = nn.Embedding(vocab, d)
                self.enc = nn.GRU(d, hidden // 2, batch_first=True, bidirectional=True)
                self.cell = nn.GRUCell(d + hidden, hidden)
                self.score = nn.Linear(hidden, hidden, bias=False)
                self.comb = nn.Linear(2 * hidden, hidden, bias=False)
                self.drop = nn.Dropout(0.2)
                self.out = nn.Linear(hidden, vocab)

            def forward(self, st):
                src, tgt_in = st
                mem, hn = self.enc(self.drop(self.src_emb(src)))
                keys = self.score(mem)
                h = torch.cat([hn[0], hn[1]], 1)
                att = torch.zeros(src.shape[0], hidden)
                emb = self.drop(self.tgt_emb(tgt_in))
                outs = []
                for t in range(tgt_in.shape[1]):
                    h = self.cell(torch.cat([emb[:, t], att], 1), h)
                    a = torch.softmax(torch.bmm(keys, h.unsqueeze(2)).squeeze(2), 1)
                    ctx = torch.bmm(a.unsqueeze(1), mem).squeeze(1)
                    att = torch.tanh(self.comb(torch.cat([ctx, h], 1)))
                    outs.append(self.drop(att))
                return self.out(torch.stack(outs, 1)).reshape(-1, vocab)

        def batch(step):
            s, t = lengths[step % len(lengths)]
            tgt = torch.randint(0, vocab, (bs, t + 1))
            return (torch.randint(0, vocab, (bs, s)), tgt[:, :-1].contiguous()), tgt[:, 1:].reshape(-1)

        return (S2S(), batch, nn.CrossEntropyLoss(), len(lengths),
                "seq2seq: bidirectional GRU encoder, GRU-cell decoder stepped per token with Luong attention, "
                "hidden 512, dropout 0.2, source 18-40 and target 20-38 tokens by step, batch 32, vocab 6000",
                {"opt": lambda p: torch.optim.Adam(p, lr=1e-3)})

    if name == "vit":
        # A vision transformer: 8x8 patches by a strided convolution, a class token, post-norm
        # encoder layers wider than the LM's (d 320, 5 heads) with dropout 0.2, label smoothing.
        d, heads, depth, bs, classes = 320, 5, 6, 32, 100

        class ViT(nn.Module):
            def __init__(self):
                super().__init__()
                self.patch = nn.Conv2d(3, d, 8, 8)
                self.cls = nn.Parameter(torch.zeros(1, 1, d))
                self.pos = nn.Parameter(torch.zeros(1, 65, d))
                layer = nn.TransformerEncoderLayer(d, heads, 3 * d, dropout=0.2, batch_first=True,
                                                   activation="gelu")
                self.enc = nn.TransformerEncoder(layer, depth)
                self.norm = nn.LayerNorm(d)
                self.head = nn.Linear(d, classes)

            def forward(self, x):
                p = self.patch(x).flatten(2).transpose(1, 2)
                h = torch.cat([self.cls.expand(x.shape[0], -1, -1), p], 1) + self.pos
                return self.head(self.norm(self.enc(h)[:, 0]))

        def batch(step):
            return torch.randn(bs, 3, 64, 64), torch.randint(0, classes, (bs,))

        return (ViT(), batch, nn.CrossEntropyLoss(label_smoothing=0.1), 6,
                "ViT, 8x8 patches of 64x64 images (64 tokens and a class token), 6 post-norm layers d 320, 5 heads, "
                "MLP 960, GELU, dropout 0.2, label smoothing, batch 32; AdamW",
                {"opt": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.05)})

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
