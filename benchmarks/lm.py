"""A small causal transformer LM in plain torch: the real workload of the tensor
engine's benchmarks and tests (``tensor_real_step``).

Two blocks of LayerNorm, causal ``scaled_dot_product_attention``, a GELU MLP,
residuals and dropout 0.1; AdamW (the default foreach path), ``clip_grad_norm_``,
a LambdaLR warmup and 2 accumulated micro-batches sliced from one data tensor.
The same code runs locally and under ``mesh.activate()``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, SEQ, BLOCKS = 64, 32, 4, 16, 2
BATCH, MICRO = 8, 2  # one data tensor: MICRO micro-batches of BATCH // MICRO rows


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, HEADS, d // HEADS).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, s, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


@contextlib.contextmanager
def one_thread():
    """Local torch on one thread, as each rank of a dp=2 mesh here (another count
    splits reductions otherwise and changes the last bits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def make(seed: int = 0):
    """``(model, optimizer, scheduler, data)``: made on the active mesh under
    ``mesh.activate()``, locally outside it."""
    torch.manual_seed(seed)
    model = LM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    return model, opt, sched, data


def step(model, opt, sched, data):
    """One training step: MICRO accumulated micro-batches, clipped, AdamW, LR step.
    Returns the last micro-batch's loss (a tensor)."""
    loss = grads_step(model, opt, data)
    opt.step()
    sched.step()
    return loss


def split_step(grads, opt, sched):
    """``step`` with its gradients from ``grads()`` (``grads_step`` compiled pure)."""
    loss = grads()
    opt.step()
    sched.step()
    return loss


def make_constant(seed: int = 0):
    """``(model, optimizer, data)``: the same model and data with SGD (momentum 0.9)
    at a constant rate and no scheduler, whose step reads no Python value that
    changes between calls (what ``mnb.compile(pure=True)`` may replay)."""
    model, _, _, data = make(seed)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), data


def constant_step(model, opt, data):
    """``step`` without a scheduler, with ``make_constant``'s SGD."""
    loss = grads_step(model, opt, data)
    opt.step()
    return loss


def grads_step(model, opt, data):
    """The part of ``step`` that reads no Python value changing between calls (the
    gradients, accumulated and clipped): ``mnb.compile(pure=True)`` replays it, and the
    optimizer and scheduler step after it, op by op (``split_step``)."""
    opt.zero_grad(set_to_none=True)
    return accumulate(model, data)


def accumulate(model, data):
    """The gradients of MICRO micro-batches, accumulated and clipped (from zeroed
    ones): one graph under ``torch.compile(backend=mnb.mesh_backend)`` with dynamo's
    ``trace_autograd_ops`` (``compiled_step``). Returns the last micro-batch's loss
    (detached: a graph's result that requires grad would end the graph there)."""
    rows = BATCH // MICRO
    for i in range(MICRO):
        chunk = data[i * rows : (i + 1) * rows]
        logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), chunk[:, 1:].reshape(-1)) / MICRO
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return loss.detach()


def compiled_step(grads, model, opt, sched, data):
    """``step`` with its gradients from ``grads`` (``accumulate`` under torch.compile):
    dynamo does not trace ``zero_grad``, and AdamW's compiled path rounds otherwise
    than eager, so both stay eager around the graph."""
    opt.zero_grad(set_to_none=True)
    loss = grads(model, data)
    opt.step()
    sched.step()
    return loss
