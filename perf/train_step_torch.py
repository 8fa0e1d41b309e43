"""train_step_torch.py: the CPU training step perf/train_syscalls.sh runs under strace beside ebb-train.

The model of ebb-train's defaults (tools/ebb-train.c): an MLP of 8 linear layers, 64 -> 512 -> ... ->
512 -> 10, ReLU between them, cross entropy against labels of a fixed random linear teacher, AdamW
(lr 2e-3), a batch of 512 drawn fresh each step, on the CPU with one thread (ebb's CPU kernels run
on one thread too; its emulated devices are host threads). After `warmup` steps it calls
os.access on a path that cannot exist, which fails harmlessly and names itself in strace's log
(the same markers ebb-train makes under EBB_TRAIN_SYSCALL_MARKERS), and again after the last step.

usage: python3 train_step_torch.py STEADY_STEPS WARMUP_STEPS
Prints `loss=<first>-><last>` (the loss must fall, as ebb-train's does).
"""
import os
import sys

import torch


def main():
    steady, warmup = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    torch.manual_seed(1)
    layers, width, inputs, classes, batch = 8, 512, 64, 10, 512
    mods = []
    for i in range(layers):
        n_in = inputs if i == 0 else width
        n_out = classes if i == layers - 1 else width
        mods.append(torch.nn.Linear(n_in, n_out))
        if i + 1 < layers:
            mods.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*mods)
    teacher = torch.randn(inputs, classes)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    first = last = None
    for step in range(warmup + steady):
        if step == warmup:
            os.access("/nonexistent/torch-train:steady-begin", os.F_OK)
        x = torch.randn(batch, inputs)
        y = (x @ teacher).argmax(dim=1)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        last = loss.item()
        if first is None:
            first = last
    os.access("/nonexistent/torch-train:steady-end", os.F_OK)
    print("loss=%.4f->%.4f" % (first, last))


if __name__ == "__main__":
    main()
